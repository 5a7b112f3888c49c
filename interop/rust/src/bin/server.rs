//! shmipc echo server (Rust `shmipc` crate, legacy v2/v3).
//!
//! Every accepted stream: read whatever arrives, write the same bytes back on the same stream,
//! until the peer closes the stream (EndOfStream); then close our side.

use std::{
    io::Write,
    os::unix::net::SocketAddr as UnixSocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use shmipc::{Error, Listener, buffer::BufferReader, stream::Stream, transport::DefaultUnixListen};
use shmipc_interop::{
    Args, SHM_FLAGS_HELP, ShmOpts, TaggedChecker, TokioTcpListen, banner, init_logging, parse_size,
    parse_size_list,
};

const USAGE: &str = "\
usage: server --unix PATH [--tcp HOST:PORT] [options]

Echo server: every byte received on a stream is written back on that stream until the peer
closes it; then the server closes its side. Prints the version banner, then \"ready\" on stdout
once all listeners are bound. Runs until killed (SIGINT/SIGTERM) or --max-streams is reached.

  --unix PATH               Unix socket path to listen on (unlinked first). Required unless --tcp.
  --tcp HOST:PORT           also (or only) listen on TCP, e.g. 127.0.0.1:7777 (file mode only:
                            memfd needs a Unix socket); port 0 picks a free port, and the
                            \"listening tcp\" line names the address actually bound
  --check-sizes LIST        check every received byte against the tagged pattern of shmlink's Go
                            interop client (stream index = id - 2; message m has size
                            LIST[m % len]); a mismatch is a stream error
  --close-after BYTES       close each stream from the server side once it has echoed at least
                            BYTES bytes (K/M suffixes ok), instead of waiting for the peer's close
  --max-streams N           exit 0 after N streams have finished (default: run forever)
  --quiet                   do not print a line per finished stream
  --help
Shared-memory options (the server maps what the client sends; these only feed Config::verify):
";

struct Counters {
    streams: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    aborted: AtomicU64,
}

fn main() {
    init_logging();
    let mut args = Args::from_env();
    let mut unix: Option<String> = None;
    let mut tcp: Option<std::net::SocketAddr> = None;
    let mut max_streams: Option<u64> = None;
    let mut quiet = false;
    let mut close_after: Option<u64> = None;
    let mut check_sizes: Option<Arc<Vec<u64>>> = None;
    let mut shm = ShmOpts::default();
    let res: Result<(), String> = (|| {
        while let Some(flag) = args.next_flag() {
            if shm.take_flag(&flag, &mut args)? {
                continue;
            }
            match flag.as_str() {
                "--unix" => unix = Some(args.value(&flag)?),
                "--tcp" => tcp = Some(args.parse(&flag)?),
                "--max-streams" => max_streams = Some(args.parse(&flag)?),
                "--quiet" => quiet = true,
                "--check-sizes" => {
                    let sizes = parse_size_list(&args.value(&flag)?)?;
                    if sizes.is_empty() || sizes.contains(&0) {
                        return Err("--check-sizes needs sizes >= 1".to_owned());
                    }
                    check_sizes = Some(Arc::new(sizes));
                }
                "--close-after" => close_after = Some(parse_size(&args.value(&flag)?)?),
                "--help" | "-h" => {
                    print!("{USAGE}{SHM_FLAGS_HELP}");
                    std::process::exit(0);
                }
                other if !other.starts_with('-') && unix.is_none() => unix = Some(other.to_owned()),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        if unix.is_none() && tcp.is_none() {
            return Err("need --unix PATH and/or --tcp ADDR".to_owned());
        }
        Ok(())
    })();
    if let Err(e) = res {
        eprintln!("server: {e}\n{USAGE}{SHM_FLAGS_HELP}");
        std::process::exit(2);
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let opts = EchoOpts {
        close_after,
        check_sizes,
    };
    let code = rt.block_on(run(unix, tcp, max_streams, quiet, opts, shm));
    std::process::exit(code);
}

async fn run(
    unix: Option<String>,
    tcp: Option<std::net::SocketAddr>,
    max_streams: Option<u64>,
    quiet: bool,
    opts: EchoOpts,
    shm: ShmOpts,
) -> i32 {
    let config = shm.to_config();
    let counters = Arc::new(Counters {
        streams: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        aborted: AtomicU64::new(0),
    });
    let done = Arc::new(tokio::sync::Notify::new());
    let mut listeners = Vec::new();

    if let Some(path) = &unix {
        let addr = match UnixSocketAddr::from_pathname(path) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("server: bad unix path {path}: {e}");
                return 2;
            }
        };
        match Listener::new(DefaultUnixListen, addr, config.clone()).await {
            Ok(l) => listeners.push(("unix", l)),
            Err(e) => {
                eprintln!("server: listen unix {path}: {e}");
                return 1;
            }
        }
    }
    let tcp_listen = TokioTcpListen::default();
    if let Some(addr) = tcp {
        match Listener::new(tcp_listen.clone(), addr, config.clone()).await {
            Ok(l) => listeners.push(("tcp", l)),
            Err(e) => {
                eprintln!("server: listen tcp {addr}: {e}");
                return 1;
            }
        }
    }

    println!("{}", banner());
    if let Some(p) = &unix {
        println!("listening unix {p}");
    }
    if let Some(a) = tcp {
        println!(
            "listening tcp {}",
            tcp_listen.bound.get().copied().unwrap_or(a)
        );
    }
    println!("ready");
    let _ = std::io::stdout().flush();

    for (kind, mut listener) in listeners {
        let counters = counters.clone();
        let done = done.clone();
        let opts = opts.clone();
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok(stream) => {
                        let counters = counters.clone();
                        let done = done.clone();
                        let opts = opts.clone();
                        tokio::spawn(async move {
                            let id = stream.stream_id();
                            let (n, err, closed_first) = echo(stream, &opts).await;
                            counters.bytes.fetch_add(n, Ordering::SeqCst);
                            if let Some(EchoError::Check(e)) = &err {
                                counters.errors.fetch_add(1, Ordering::SeqCst);
                                eprintln!("server: {kind} stream {id}: received bytes differ: {e}");
                            } else if let Some(EchoError::Stream(e)) = &err {
                                if matches!(e, Error::StreamClosed | Error::SessionShutdown) {
                                    // The session went away (the client hard-closes it right
                                    // after closing its streams) before we saw the stream's
                                    // close event: not an echo failure.
                                    counters.aborted.fetch_add(1, Ordering::SeqCst);
                                    if !quiet {
                                        println!(
                                            "stream {id} aborted by session close after echoing {n} bytes ({e})"
                                        );
                                    }
                                } else {
                                    counters.errors.fetch_add(1, Ordering::SeqCst);
                                    eprintln!(
                                        "server: {kind} stream {id}: error after {n} bytes: {e}"
                                    );
                                }
                            } else if !quiet {
                                let how = if closed_first {
                                    "closed by server"
                                } else {
                                    "closed"
                                };
                                println!("stream {id} {how} after echoing {n} bytes");
                            }
                            let total = counters.streams.fetch_add(1, Ordering::SeqCst) + 1;
                            if max_streams.is_some_and(|m| total >= m) {
                                done.notify_one();
                            }
                        });
                    }
                    Err(e) => {
                        eprintln!("server: {kind} accept failed: {e}");
                        return;
                    }
                }
            }
        });
    }

    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal");
    tokio::select! {
        _ = done.notified() => {}
        _ = tokio::signal::ctrl_c() => {}
        _ = sigterm.recv() => {}
    }
    let errors = counters.errors.load(Ordering::SeqCst);
    println!(
        "server: done streams={} bytes={} errors={} aborted_by_session_close={}",
        counters.streams.load(Ordering::SeqCst),
        counters.bytes.load(Ordering::SeqCst),
        errors,
        counters.aborted.load(Ordering::SeqCst)
    );
    let _ = std::io::stdout().flush();
    if errors > 0 { 1 } else { 0 }
}

#[derive(Clone)]
struct EchoOpts {
    close_after: Option<u64>,
    check_sizes: Option<Arc<Vec<u64>>>,
}

enum EchoError {
    Stream(Error),
    Check(String),
}

/// Echo until EndOfStream, or until `close_after` bytes were echoed. Returns (bytes echoed,
/// error if any, whether the server closed the stream first).
async fn echo(mut stream: Stream, opts: &EchoOpts) -> (u64, Option<EchoError>, bool) {
    let mut checker = opts.check_sizes.as_ref().map(|sizes| {
        TaggedChecker::new(
            sizes.clone(),
            u64::from(stream.stream_id()).saturating_sub(2),
        )
    });
    let mut total = 0u64;
    let mut pending: Vec<u8> = Vec::new();
    let err = loop {
        // Wait for at least one chunk, then take everything already buffered (a message spans
        // one chunk per shared-memory slice) so we answer with one message per arrival batch.
        match stream.read_chunk().await {
            Ok(chunk) => pending.extend_from_slice(&chunk),
            Err(Error::EndOfStream) => break None,
            Err(e) => break Some(EchoError::Stream(e)),
        }
        while !stream.recv_buf().is_empty() {
            match stream.read_chunk().await {
                Ok(chunk) => pending.extend_from_slice(&chunk),
                Err(e) => return (total, Some(EchoError::Stream(e)), false),
            }
        }
        stream.recv_buf().release_previous_read();
        if let Some(c) = checker.as_mut()
            && let Err(e) = c.check(&pending)
        {
            let _ = stream.close().await;
            return (total, Some(EchoError::Check(e)), false);
        }
        if let Err(e) = stream.write_bytes(&pending) {
            break Some(EchoError::Stream(e));
        }
        if let Err(e) = stream.flush(false).await {
            break Some(EchoError::Stream(e));
        }
        total += pending.len() as u64;
        pending.clear();
        if opts.close_after.is_some_and(|limit| total >= limit) {
            // Server-initiated close: the peer reads EndOfStream after the echo.
            return match stream.close().await {
                Ok(()) => (total, None, true),
                Err(e) => (total, Some(EchoError::Stream(e)), true),
            };
        }
    };
    // Peer closed (or error): close our side. After a peer close this sends nothing (the crate
    // only sends a close event if our stream was still fully open).
    let _ = stream.close().await;
    (total, err, false)
}
