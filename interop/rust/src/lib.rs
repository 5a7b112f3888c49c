//! Shared helpers for the `server` and `client` interop binaries.
//!
//! Both binaries speak the shmipc protocol through the crates.io `shmipc` crate in its default
//! "legacy" mode (file-backed shared memory -> protocol v2, memfd -> protocol v3).

use std::{net::SocketAddr, str::FromStr, time::Duration};

use shmipc::{
    config::{Config, SizePercentPair},
    consts::MemMapType,
    transport::TransportListen,
};

/// Version of the `shmipc` crate this tool was built against (kept in sync with Cargo.toml).
pub const SHMIPC_CRATE_VERSION: &str = "0.2.1";

/// Print the version banner line both binaries emit on start-up.
pub fn banner() -> String {
    format!("shmipc-interop: shmipc {SHMIPC_CRATE_VERSION} (legacy mode: file=v2, memfd=v3)")
}

/// Minimal argument cursor: `--flag value` and `--flag=value` forms.
pub struct Args {
    items: Vec<String>,
    pos: usize,
}

impl Args {
    pub fn from_env() -> Self {
        Self {
            items: std::env::args().skip(1).collect(),
            pos: 0,
        }
    }

    /// Returns the next flag name (with any `=value` split off and queued).
    pub fn next_flag(&mut self) -> Option<String> {
        let item = self.items.get(self.pos)?.clone();
        self.pos += 1;
        if let Some(rest) = item.strip_prefix("--")
            && let Some((name, value)) = rest.split_once('=')
        {
            self.items.insert(self.pos, value.to_owned());
            return Some(format!("--{name}"));
        }
        Some(item)
    }

    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        let v = self
            .items
            .get(self.pos)
            .cloned()
            .ok_or_else(|| format!("{flag} needs a value"))?;
        self.pos += 1;
        Ok(v)
    }

    pub fn parse<T: FromStr>(&mut self, flag: &str) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        let v = self.value(flag)?;
        v.parse::<T>()
            .map_err(|e| format!("bad value {v:?} for {flag}: {e}"))
    }
}

/// Parse a size with optional K/M/G suffix (binary units): `4096`, `64K`, `4M`, `1G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1u64 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1u64 << 30),
        _ => (s, 1),
    };
    let n: u64 = num.parse().map_err(|e| format!("bad size {s:?}: {e}"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

pub fn parse_size_list(s: &str) -> Result<Vec<u64>, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(parse_size)
        .collect()
}

/// `SIZE:PERCENT,...`, e.g. `8172:50,32748:30,131052:20` (slice data sizes, excluding the 20-byte
/// slice header).
pub fn parse_slices(s: &str) -> Result<Vec<SizePercentPair>, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (size, pct) = p
                .split_once(':')
                .ok_or_else(|| format!("slice class {p:?} must be SIZE:PERCENT"))?;
            Ok(SizePercentPair {
                size: u32::try_from(parse_size(size)?).map_err(|e| e.to_string())?,
                percent: pct
                    .parse()
                    .map_err(|e| format!("bad percent in {p:?}: {e}"))?,
            })
        })
        .collect()
}

pub fn parse_mem(s: &str) -> Result<MemMapType, String> {
    match s {
        "memfd" | "v3" => Ok(MemMapType::MemMapTypeMemFd),
        "file" | "v2" | "devshm" => Ok(MemMapType::MemMapTypeDevShmFile),
        other => Err(format!("--mem must be memfd or file, got {other:?}")),
    }
}

pub fn mem_name(m: MemMapType) -> &'static str {
    match m {
        MemMapType::MemMapTypeMemFd => "memfd",
        MemMapType::MemMapTypeDevShmFile => "file",
    }
}

/// Deterministic payload byte `i` of message `msg` on stream index `stream`.
///
/// `b[i] = (i*31 + (i >> 8) + stream*7 + msg*13) mod 251` — 251 is prime so the pattern does not
/// line up with slice boundaries (powers of two) and a shifted/misplaced chunk is detected.
#[inline]
pub fn pattern_byte(stream: u64, msg: u64, i: u64) -> u8 {
    ((i.wrapping_mul(31)
        .wrapping_add(i >> 8)
        .wrapping_add(stream.wrapping_mul(7))
        .wrapping_add(msg.wrapping_mul(13)))
        % 251) as u8
}

pub fn fill_pattern(buf: &mut [u8], stream: u64, msg: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(stream, msg, i as u64);
    }
}

/// Initialise a `tracing` subscriber writing to stderr; level from `SHMIPC_INTEROP_LOG`
/// (error|warn|info|debug|trace; default error). The crate logs fallbacks at warn and the
/// handshake at info.
pub fn init_logging() {
    let level = match std::env::var("SHMIPC_INTEROP_LOG").as_deref() {
        Ok("trace") => tracing::Level::TRACE,
        Ok("debug") => tracing::Level::DEBUG,
        Ok("info") => tracing::Level::INFO,
        Ok("warn") => tracing::Level::WARN,
        _ => tracing::Level::ERROR,
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// Common shmipc [`Config`] knobs shared by both binaries.
pub struct ShmOpts {
    pub mem: MemMapType,
    pub buffer_size: u32,
    pub slices: Option<Vec<SizePercentPair>>,
    pub queue_cap: Option<u32>,
    pub shm_dir: String,
    pub prefix: String,
    pub handshake_timeout: Duration,
}

impl Default for ShmOpts {
    fn default() -> Self {
        Self {
            mem: MemMapType::MemMapTypeMemFd,
            buffer_size: shmipc::consts::DEFAULT_SHARE_MEMORY_CAP,
            slices: None,
            queue_cap: None,
            shm_dir: "/dev/shm".to_owned(),
            prefix: "shmipc_interop".to_owned(),
            handshake_timeout: Duration::from_millis(1000),
        }
    }
}

impl ShmOpts {
    /// Try to consume one of the shared flags; returns Ok(true) if it was one.
    pub fn take_flag(&mut self, flag: &str, args: &mut Args) -> Result<bool, String> {
        match flag {
            "--mem" => self.mem = parse_mem(&args.value(flag)?)?,
            "--buffer-size" => {
                let v = parse_size(&args.value(flag)?)?;
                self.buffer_size =
                    u32::try_from(v).map_err(|_| "--buffer-size too large".to_owned())?;
            }
            "--slices" => self.slices = Some(parse_slices(&args.value(flag)?)?),
            "--queue-cap" => self.queue_cap = Some(args.parse(flag)?),
            "--shm-dir" => self.shm_dir = args.value(flag)?,
            "--prefix" => self.prefix = args.value(flag)?,
            "--handshake-timeout-ms" => {
                self.handshake_timeout = Duration::from_millis(args.parse(flag)?)
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    pub fn to_config(&self) -> Config {
        let mut c = Config::default();
        c.mem_map_type = self.mem;
        c.share_memory_buffer_cap = self.buffer_size;
        if let Some(s) = &self.slices {
            c.buffer_slice_sizes = s.clone();
        }
        if let Some(q) = self.queue_cap {
            c.queue_cap = q;
        }
        let dir = self.shm_dir.trim_end_matches('/');
        // The crate appends "_<pid>" (client), then "_queue_<session>" / "_buffer".
        c.share_memory_path_prefix = format!("{dir}/{}", self.prefix);
        c.queue_path = format!("{dir}/{}_queue", self.prefix);
        c.initialize_timeout = self.handshake_timeout;
        c
    }
}

pub const SHM_FLAGS_HELP: &str = "\
  --mem memfd|file          shared-memory kind: memfd => protocol v3 (ExchangeProtoVersion,
                            ShareMemoryByMemfd, SCM_RIGHTS), file => protocol v2 (ShareMemoryByFilePath,
                            no reply). Default memfd. (Server side: only informational in legacy mode.)
  --buffer-size BYTES       shared buffer region size (K/M/G suffixes ok). Default 32M; the crate
                            refuses < 1M. Use 1M plus big payloads/many streams to force fallback.
  --slices SIZE:PCT,...     slice classes (data bytes excl. 20-byte header); default
                            8172:50,32748:30,131052:20
  --queue-cap N             IO-queue capacity in events (crate rounds up to a multiple of 8; default 8192)
  --shm-dir DIR             directory for file-backed shm (default /dev/shm); memfd names use it too
  --prefix NAME             shm name prefix (default shmipc_interop); crate appends _<pid>_buffer and
                            _<pid>_queue_<session>
  --handshake-timeout-ms MS handshake timeout (default 1000)
";

/// TCP listener that, unlike `shmipc::transport::DefaultTcpListen` (which wraps a *blocking*
/// std listener), binds a proper non-blocking tokio listener. It records the address it bound
/// (so `--tcp 127.0.0.1:0` can report the port the kernel chose).
#[derive(Clone, Debug, Default)]
pub struct TokioTcpListen {
    pub bound: std::sync::Arc<std::sync::OnceLock<SocketAddr>>,
}

impl TransportListen for TokioTcpListen {
    type Listener = tokio::net::TcpListener;
    type Address = SocketAddr;

    async fn listen(&self, addr: Self::Address) -> std::io::Result<Self::Listener> {
        let l = tokio::net::TcpListener::bind(addr).await?;
        let _ = self.bound.set(l.local_addr()?);
        Ok(l)
    }
}

/// Byte `i` of message `msg` on stream index `stream` in the *tagged* pattern that shmlink's Go
/// interop client sends: every aligned 8 bytes are `stream as u16 | msg as u16 | (i & !7) as u32`
/// (little-endian), so a wrong byte names the stream, message and offset it belongs to.
#[inline]
pub fn tagged_byte(stream: u64, msg: u64, i: u64) -> u8 {
    let mut tag = [0u8; 8];
    tag[0..2].copy_from_slice(&(stream as u16).to_le_bytes());
    tag[2..4].copy_from_slice(&(msg as u16).to_le_bytes());
    tag[4..8].copy_from_slice(&((i & !7) as u32).to_le_bytes());
    tag[(i % 8) as usize]
}

/// Checks the bytes a stream receives against the tagged pattern, message by message, where
/// message `m` has size `sizes[m % sizes.len()]`.
pub struct TaggedChecker {
    sizes: std::sync::Arc<Vec<u64>>,
    stream: u64,
    msg: u64,
    off: u64,
}

impl TaggedChecker {
    pub fn new(sizes: std::sync::Arc<Vec<u64>>, stream: u64) -> Self {
        Self {
            sizes,
            stream,
            msg: 0,
            off: 0,
        }
    }

    /// Checks the next bytes of the stream; on the first mismatch returns where it is and what
    /// arrived (the checker is then of no further use).
    pub fn check(&mut self, data: &[u8]) -> Result<(), String> {
        for (j, &b) in data.iter().enumerate() {
            let want = tagged_byte(self.stream, self.msg, self.off);
            if b != want {
                let got = &data[j..(j + 8).min(data.len())];
                return Err(format!(
                    "message {} byte {}: got {:02x?} (want {want:#04x}) at {} of a batch of {} bytes",
                    self.msg,
                    self.off,
                    got,
                    j,
                    data.len()
                ));
            }
            self.off += 1;
            if self.off == self.sizes[(self.msg as usize) % self.sizes.len()] {
                self.msg += 1;
                self.off = 0;
            }
        }
        Ok(())
    }
}
