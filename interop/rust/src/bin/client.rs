//! shmipc verifying echo client (Rust `shmipc` crate, legacy v2/v3).
//!
//! Opens N streams on one session, and on each (concurrently) sends payloads of the given sizes
//! with a deterministic pattern, reads the echo back, verifies every byte, then closes the stream.

use std::{
    io::Write,
    os::unix::net::SocketAddr as UnixSocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use shmipc::{
    Error,
    buffer::BufferReader,
    session::{SessionManager, SessionManagerConfig},
    stats::StatsSnapshot,
    stream::Stream,
    transport::{DefaultTcpConnect, DefaultUnixConnect, TransportConnect, TransportStream},
};
use shmipc_interop::{
    Args, SHM_FLAGS_HELP, ShmOpts, banner, fill_pattern, init_logging, mem_name, parse_size_list,
    pattern_byte,
};

const USAGE: &str = "\
usage: client --unix PATH [options]     (or --tcp HOST:PORT, file mode only)

Opens --streams streams on one shmipc session (all opened before any data is sent), then on
every stream concurrently, for each round and each size: writes one message of that size
(byte i of message m on stream s = (i*31 + (i>>8) + s*7 + m*13) mod 251), flushes, reads until
the same number of bytes came back, verifies every byte. Then closes each stream and the session.
Exit 0 on success; 1 with a message on stderr on any failure (2 on bad usage).

  --unix PATH               server's Unix socket path
  --tcp HOST:PORT           connect over TCP instead (the crate's memfd mode needs Unix)
  --streams N               concurrent streams (default 1)
  --sizes LIST              comma list of payload sizes, K/M suffixes ok
                            (default 1,100,4096,65536,1048576,4194304)
  --rounds N                repeat the size list N times per stream (default 1)
  --sessions N              sessions in the SessionManager (default 1)
  --timeout-s S             overall deadline in seconds (default 120)
  --expect-fallback         fail unless at least one message went as FallbackData (either way)
  --expect-no-fallback      fail if any message went as FallbackData
  --expect-eof              after the last echo, require the server to close each stream first
                            (EndOfStream with no extra byte) before closing it on this side
  --no-close                skip SessionManager::close() at the end (it may wait up to 5 s for
                            buffers to come back before unmapping)
  --help
Shared-memory options:
";

struct Opts {
    unix: Option<String>,
    tcp: Option<std::net::SocketAddr>,
    streams: usize,
    sizes: Vec<u64>,
    rounds: u64,
    sessions: usize,
    timeout: Duration,
    expect_fallback: Option<bool>,
    expect_eof: bool,
    close: bool,
    shm: ShmOpts,
}

fn parse_opts() -> Result<Opts, String> {
    let mut args = Args::from_env();
    let mut o = Opts {
        unix: None,
        tcp: None,
        streams: 1,
        sizes: vec![1, 100, 4096, 65536, 1 << 20, 4 << 20],
        rounds: 1,
        sessions: 1,
        timeout: Duration::from_secs(120),
        expect_fallback: None,
        expect_eof: false,
        close: true,
        shm: ShmOpts::default(),
    };
    while let Some(flag) = args.next_flag() {
        if o.shm.take_flag(&flag, &mut args)? {
            continue;
        }
        match flag.as_str() {
            "--unix" => o.unix = Some(args.value(&flag)?),
            "--tcp" => o.tcp = Some(args.parse(&flag)?),
            "--streams" => o.streams = args.parse(&flag)?,
            "--sizes" => o.sizes = parse_size_list(&args.value(&flag)?)?,
            "--rounds" => o.rounds = args.parse(&flag)?,
            "--sessions" => o.sessions = args.parse(&flag)?,
            "--timeout-s" => o.timeout = Duration::from_secs_f64(args.parse(&flag)?),
            "--expect-fallback" => o.expect_fallback = Some(true),
            "--expect-no-fallback" => o.expect_fallback = Some(false),
            "--expect-eof" => o.expect_eof = true,
            "--no-close" => o.close = false,
            "--help" | "-h" => {
                print!("{USAGE}{SHM_FLAGS_HELP}");
                std::process::exit(0);
            }
            other if !other.starts_with('-') && o.unix.is_none() => o.unix = Some(other.to_owned()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if o.unix.is_none() == o.tcp.is_none() {
        return Err("need exactly one of --unix PATH or --tcp ADDR".to_owned());
    }
    if o.streams == 0 || o.sessions == 0 {
        return Err("--streams and --sessions must be >= 1".to_owned());
    }
    if o.sizes.iter().any(|&s| s == 0) {
        return Err("sizes must be >= 1".to_owned());
    }
    Ok(o)
}

fn main() {
    init_logging();
    let opts = match parse_opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("client: {e}\n{USAGE}{SHM_FLAGS_HELP}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = rt.block_on(async move {
        let deadline = opts.timeout;
        let res = match (&opts.unix, opts.tcp) {
            (Some(path), _) => match UnixSocketAddr::from_pathname(path) {
                Ok(addr) => {
                    tokio::time::timeout(deadline, run(&opts, DefaultUnixConnect, addr)).await
                }
                Err(e) => Ok(Err(format!("bad unix path {path}: {e}"))),
            },
            (None, Some(addr)) => {
                tokio::time::timeout(deadline, run(&opts, DefaultTcpConnect, addr)).await
            }
            _ => unreachable!(),
        };
        match res {
            Ok(Ok(())) => 0,
            Ok(Err(e)) => {
                eprintln!("client: FAIL: {e}");
                1
            }
            Err(_) => {
                eprintln!("client: FAIL: timed out after {:?}", deadline);
                1
            }
        }
    });
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

async fn run<C>(opts: &Opts, connect: C, addr: C::Address) -> Result<(), String>
where
    C: TransportConnect + Send + Sync + 'static,
    C::Stream: Send,
    <C::Stream as TransportStream>::ReadHalf: Send + 'static,
    <C::Stream as TransportStream>::WriteHalf: Send + 'static,
    C::Address: Clone + Send + Sync,
{
    println!("{}", banner());
    let config = opts.shm.to_config();
    println!(
        "client: mem={} (protocol v{}) buffer_size={} streams={} sizes={:?} rounds={}",
        mem_name(opts.shm.mem),
        match opts.shm.mem {
            shmipc::consts::MemMapType::MemMapTypeMemFd => 3,
            shmipc::consts::MemMapType::MemMapTypeDevShmFile => 2,
        },
        config.share_memory_buffer_cap,
        opts.streams,
        opts.sizes,
        opts.rounds
    );
    let sm_config = SessionManagerConfig::new()
        .with_config(config)
        .with_session_num(opts.sessions);
    let t0 = Instant::now();
    let sm = SessionManager::new(sm_config, connect, addr)
        .await
        .map_err(|e| format!("connect/handshake failed: {e}"))?;
    println!("client: session(s) up in {:?}", t0.elapsed());

    // Open every stream before any data moves: a fallback (FallbackData sent or received)
    // trips the crate's per-session circuit breaker, after which get_stream() fails with
    // SessionUnhealthy for 30 s.
    let mut streams = Vec::with_capacity(opts.streams);
    for i in 0..opts.streams {
        let s = sm
            .get_stream()
            .map_err(|e| format!("get_stream #{i} failed: {e}"))?;
        streams.push(s);
    }
    let ids: Vec<u32> = streams.iter().map(|s| s.stream_id()).collect();
    println!(
        "client: opened {} streams, ids {}..{}",
        ids.len(),
        ids.first().unwrap(),
        ids.last().unwrap()
    );

    let sizes = Arc::new(opts.sizes.clone());
    let rounds = opts.rounds;
    let expect_eof = opts.expect_eof;
    let t1 = Instant::now();
    let mut tasks = Vec::with_capacity(streams.len());
    for (idx, stream) in streams.into_iter().enumerate() {
        let sizes = sizes.clone();
        tasks.push(tokio::spawn(async move {
            exercise(stream, idx as u64, &sizes, rounds, expect_eof).await
        }));
    }
    let mut failures = Vec::new();
    let mut total = 0u64;
    for (idx, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(Ok(n)) => total += n,
            Ok(Err(e)) => failures.push(format!("stream #{idx} (id {}): {e}", ids[idx])),
            Err(e) => failures.push(format!(
                "stream #{idx} (id {}): task panicked: {e}",
                ids[idx]
            )),
        }
    }
    let elapsed = t1.elapsed();
    let stats = sm.stats_snapshot();
    print_stats(&stats);
    println!(
        "client: {} bytes each way in {:?} ({:.1} MiB/s)",
        total,
        elapsed,
        total as f64 / (1 << 20) as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    if opts.close {
        let t2 = Instant::now();
        sm.close().await;
        println!("client: session closed in {:?}", t2.elapsed());
    }
    if !failures.is_empty() {
        let n = failures.len();
        let shown: Vec<_> = failures.into_iter().take(10).collect();
        return Err(format!("{n} stream(s) failed:\n  {}", shown.join("\n  ")));
    }
    let fell_back = stats.fallback_write_count + stats.fallback_read_count > 0;
    match opts.expect_fallback {
        Some(true) if !fell_back => return Err("expected fallback, but none happened".to_owned()),
        Some(false) if fell_back => {
            return Err(format!(
                "expected no fallback, but fallback_write={} fallback_read={}",
                stats.fallback_write_count, stats.fallback_read_count
            ));
        }
        _ => {}
    }
    println!("client: OK");
    Ok(())
}

fn print_stats(s: &StatsSnapshot) {
    println!(
        "client: stats fallback_write={} fallback_read={} queue_full={} polling_sent={} \
         polling_recv={} conn_errors={} out_bytes={} in_bytes={}",
        s.fallback_write_count,
        s.fallback_read_count,
        s.queue_full_error_count,
        s.send_polling_event_count,
        s.recv_polling_event_count,
        s.event_conn_error_count,
        s.out_flow_bytes,
        s.in_flow_bytes
    );
}

async fn exercise(
    mut stream: Stream,
    idx: u64,
    sizes: &[u64],
    rounds: u64,
    expect_eof: bool,
) -> Result<u64, String> {
    let mut msg = 0u64;
    let mut total = 0u64;
    let mut payload = Vec::new();
    for _ in 0..rounds {
        for &size in sizes {
            let size_us = size as usize;
            payload.resize(size_us, 0);
            fill_pattern(&mut payload, idx, msg);
            stream
                .write_bytes(&payload)
                .map_err(|e| format!("msg {msg} size {size}: write_bytes: {e}"))?;
            stream
                .flush(false)
                .await
                .map_err(|e| format!("msg {msg} size {size}: flush: {e}"))?;
            let mut got = 0usize;
            while got < size_us {
                let chunk = match stream.read_chunk().await {
                    Ok(c) => c,
                    Err(Error::EndOfStream) => {
                        return Err(format!(
                            "msg {msg} size {size}: peer closed the stream after {got} bytes"
                        ));
                    }
                    Err(e) => {
                        return Err(format!(
                            "msg {msg} size {size}: read after {got} bytes: {e}"
                        ));
                    }
                };
                if got + chunk.len() > size_us {
                    return Err(format!(
                        "msg {msg} size {size}: got {} bytes, more than sent",
                        got + chunk.len()
                    ));
                }
                for (j, &b) in chunk.iter().enumerate() {
                    let i = (got + j) as u64;
                    let want = pattern_byte(idx, msg, i);
                    if b != want {
                        return Err(format!(
                            "msg {msg} size {size}: byte {i} is {b:#04x}, want {want:#04x}"
                        ));
                    }
                }
                got += chunk.len();
            }
            stream.recv_buf().release_previous_read();
            total += size;
            msg += 1;
        }
    }
    if expect_eof {
        match stream.read_chunk().await {
            Err(Error::EndOfStream) => {}
            Ok(chunk) => {
                return Err(format!(
                    "expected the server's close after {total} bytes, got {} more bytes",
                    chunk.len()
                ));
            }
            Err(e) => {
                return Err(format!(
                    "expected the server's close after {total} bytes: {e}"
                ));
            }
        }
    }
    stream.close().await.map_err(|e| format!("close: {e}"))?;
    Ok(total)
}
