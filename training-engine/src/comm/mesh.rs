//! A full mesh of TCP connections and a poll-based progress engine that drives many
//! concurrent sends and receives (full duplex, no helper threads, every wait bounded).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::Ctx;
use super::error::{CommError, Result};
use super::op::Traffic;
use super::shm::{SpinBudget, WaitKind};
use super::store::try_get;

const MAGIC: u32 = 0x5253_524e; // "RSRN"
/// Socket buffer size requested (the kernel caps it at net.core.{r,w}mem_max).
const SOCK_BUF: libc::c_int = 4 << 20;
/// Most bytes handed to one `write(2)` while a rank both sends and receives. Each such pass of
/// [`Mesh::run`] (and every pass of [`Mesh::duplex`]) makes at most one write and one read per
/// transfer, so the rank alternates the two in small steps: its peer's data is drained (and the
/// peer's window reopened) while the peer is still busy, instead of one side parking in `poll`
/// while the other finishes a long burst. Measured on 2 ranks over loopback, the two-phase ring
/// all_reduce of 64 MiB took 38–40 ms this way against 47–55 ms with unbounded bursts.
const SEND_BURST: usize = 256 << 10;

/// One outgoing transfer.
pub(crate) struct SendOp<'a> {
    pub(crate) peer: usize,
    pub(crate) data: &'a [u8],
    done: usize,
}

impl<'a> SendOp<'a> {
    pub(crate) fn new(peer: usize, data: &'a [u8]) -> Self {
        SendOp {
            peer,
            data,
            done: 0,
        }
    }
}

enum Target<'a> {
    Slice(&'a mut [u8]),
    /// `total` bytes received through one reusable `slot`: byte `i` lands at
    /// `slot[i % slot.len()]`, and the segment callback sees every full slot (and the last,
    /// partial one) before it is overwritten. The slot stays in cache, so the kernel's copy and
    /// the callback's read of it do not go to memory.
    Ring {
        slot: &'a mut [u8],
        total: usize,
    },
    /// A message prefixed by its length (u64 little endian); the body is allocated on arrival,
    /// and a length above `max` is an error (never an allocation a peer's bytes chose).
    Framed {
        len: [u8; 8],
        len_got: usize,
        max: usize,
        body: Option<Vec<u8>>,
    },
}

/// One incoming transfer.
pub(crate) struct RecvOp<'a> {
    pub(crate) peer: usize,
    target: Target<'a>,
    done: usize,
    notified: usize,
}

impl<'a> RecvOp<'a> {
    pub(crate) fn new(peer: usize, buf: &'a mut [u8]) -> Self {
        RecvOp {
            peer,
            target: Target::Slice(buf),
            done: 0,
            notified: 0,
        }
    }

    /// Receives `total` bytes through `slot` (non-empty unless `total` is 0), one `slot.len()`
    /// segment at a time; see [`Target::Ring`]. Only [`Mesh::run`]'s segment callback sees the data.
    pub(crate) fn ring(peer: usize, slot: &'a mut [u8], total: usize) -> Self {
        RecvOp {
            peer,
            target: Target::Ring { slot, total },
            done: 0,
            notified: 0,
        }
    }

    /// A message of at most `max` bytes, prefixed by its length.
    pub(crate) fn framed(peer: usize, max: usize) -> RecvOp<'static> {
        RecvOp {
            peer,
            target: Target::Framed {
                len: [0; 8],
                len_got: 0,
                max,
                body: None,
            },
            done: 0,
            notified: 0,
        }
    }

    /// The body of a framed receive.
    pub(crate) fn into_body(self) -> Vec<u8> {
        match self.target {
            Target::Framed { body, .. } => body.unwrap_or_default(),
            Target::Slice(_) | Target::Ring { .. } => Vec::new(),
        }
    }

    fn total(&self) -> Option<usize> {
        match &self.target {
            Target::Slice(b) => Some(b.len()),
            Target::Ring { total, .. } => Some(*total),
            Target::Framed { body, .. } => body.as_ref().map(|b| b.len()),
        }
    }

    fn complete(&self) -> bool {
        self.total() == Some(self.done)
    }
}

/// The store key under which rank `rank` of the group `prefix` publishes why it aborted
/// (`"<origin>\n<error>"`), read by its peers on either backend.
pub(crate) fn abort_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/abort/{rank}")
}

/// Frames `body` with its length.
pub(crate) fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(body.len() + 8);
    v.extend_from_slice(&(body.len() as u64).to_le_bytes());
    v.extend_from_slice(body);
    v
}

/// Segment callback: `(recv index, byte range completed, the bytes)`.
pub(crate) type OnSegment<'f> = dyn FnMut(usize, std::ops::Range<usize>, &[u8]) -> Result<()> + 'f;

/// A two-way byte stream with one peer whose outgoing bytes may depend on incoming ones, driven
/// by [`Mesh::duplex`]: it asks for the next bytes to send and where the next received bytes go,
/// and reports how many moved.
pub(crate) trait Duplex {
    /// The unsent rest of the current outgoing piece; `None` or empty when nothing can be sent
    /// now (it waits on incoming data) or everything has been sent.
    fn outgoing(&self) -> Option<&[u8]>;
    /// `n` bytes of [`Duplex::outgoing`] went out.
    fn sent(&mut self, n: usize);
    /// Where the next incoming bytes go (at most the rest of the current piece); `None` or
    /// empty when everything has arrived.
    fn incoming(&mut self) -> Option<&mut [u8]>;
    /// `n` bytes arrived at the front of the last [`Duplex::incoming`].
    ///
    /// # Errors
    /// Whatever processing the data can fail with.
    fn received(&mut self, n: usize) -> Result<()>;
    /// Everything has been sent and received.
    fn finished(&self) -> bool;
}

/// The connection to `peer` among `socks` (of a group of `world`).
fn sock_of(socks: &[Option<TcpStream>], world: usize, peer: usize) -> Result<&TcpStream> {
    socks
        .get(peer)
        .and_then(|s| s.as_ref())
        .ok_or(CommError::InvalidRank {
            what: "peer",
            rank: peer,
            world,
        })
}

/// What a read returning 0 bytes means: the peer closed its end.
const CLOSED_BY_PEER: &str = "connection closed (peer exited or aborted)";

/// Full mesh of TCP connections between the ranks of one group.
pub(crate) struct Mesh {
    ctx: Ctx,
    socks: Vec<Option<TcpStream>>,
    aborted: bool,
    /// Recent stalls inside [`Mesh::duplex`]: how long to spin before sleeping in `poll`.
    budget: SpinBudget,
}

fn set_sock_opts(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)
        .map_err(|e| CommError::io("setting TCP_NODELAY", e))?;
    let fd = s.as_raw_fd();
    let [snd_allowed, rcv_allowed] = *sock_buf_allowed();
    for (opt, allowed) in [(libc::SO_SNDBUF, snd_allowed), (libc::SO_RCVBUF, rcv_allowed)] {
        // A fixed size turns the kernel's autotuning off for the socket. Below SOCK_BUF the
        // kernel's cap (net.core.{w,r}mem_max, 208 KiB by default) would pin the buffer under
        // what autotuning reaches (tcp_{w,r}mem's maximum, MiBs): between hosts, a window of a
        // few hundred KiB caps a long or fast link. So the size is set only where the cap allows
        // all of it.
        if !allowed {
            continue;
        }
        let v: libc::c_int = SOCK_BUF;
        // SAFETY: `fd` is an open socket owned by `s`; the option value is a c_int on our stack
        // and the length passed matches it.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(CommError::io(
                "setting socket buffer size",
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

/// Whether `net.core.wmem_max` and `net.core.rmem_max` let a socket's send and receive buffers
/// hold [`SOCK_BUF`] bytes (read once per process; an unreadable value is taken as no).
fn sock_buf_allowed() -> &'static [bool; 2] {
    static CAPS: std::sync::OnceLock<[bool; 2]> = std::sync::OnceLock::new();
    CAPS.get_or_init(|| {
        ["wmem_max", "rmem_max"].map(|c| {
            std::fs::read_to_string(format!("/proc/sys/net/core/{c}"))
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .is_some_and(|max| max >= SOCK_BUF as u64)
        })
    })
}

/// The acceptor's answer to a hello it took.
const HELLO_ACK: u8 = 0xA5;

/// A random listener token: from the kernel's generator, else from std's per-process random
/// hash keys (never fails; it only has to differ between listeners).
pub(crate) fn random_token() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok() {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

/// The address peers should use to reach this process: `opt` when given, else the interface
/// that routes to `MASTER_ADDR`, else 127.0.0.1. A group spanning hosts (`multi_host`) whose
/// `MASTER_ADDR` is a host name that resolves here to loopback only (Debian's `127.0.1.1` line
/// for the host's own name in /etc/hosts) advertises the default route's interface instead, or,
/// without one, fails naming the address: its peers on other hosts cannot reach loopback, and
/// would otherwise time out connecting. A loopback IP given as such is taken as meant.
pub(crate) fn advertise_addr(opt: Option<IpAddr>, multi_host: bool) -> std::result::Result<IpAddr, String> {
    if let Some(a) = opt {
        return Ok(a);
    }
    advertise_from(std::env::var("MASTER_ADDR").ok().as_deref(), multi_host)
}

/// The local address a UDP socket would send to `target` from (no packet is sent).
fn route_to(target: SocketAddr) -> Option<IpAddr> {
    let any: IpAddr = if target.is_ipv6() { Ipv6Addr::UNSPECIFIED.into() } else { Ipv4Addr::UNSPECIFIED.into() };
    let u = std::net::UdpSocket::bind((any, 0)).ok()?;
    u.connect(target).ok()?;
    Some(u.local_addr().ok()?.ip())
}

/// [`advertise_addr`] for a given `MASTER_ADDR`.
fn advertise_from(master: Option<&str>, multi_host: bool) -> std::result::Result<IpAddr, String> {
    use std::net::ToSocketAddrs;
    let Some(m) = master else {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    };
    let literal = m.parse::<IpAddr>().is_ok();
    let targets: Vec<SocketAddr> = (m, 9).to_socket_addrs().map(|a| a.collect()).unwrap_or_default();
    // A name of this host that resolves to loopback only, in a group spanning hosts.
    let misleading = multi_host && !literal && !targets.is_empty() && targets.iter().all(|t| t.ip().is_loopback());
    if !misleading {
        let Some(target) = targets.first() else {
            return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
        };
        if target.ip().is_loopback() {
            return Ok(target.ip());
        }
        return Ok(route_to(*target).unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    }
    let resolved: Vec<String> = targets.iter().map(|t| t.ip().to_string()).collect();
    default_route().ok_or_else(|| {
        format!(
            "the ranks span hosts, but MASTER_ADDR={m:?} resolves here to loopback only ([{}]) and this host has no \
             default route to take an address from: peers on other hosts cannot reach a loopback address. Give \
             MASTER_ADDR as an address every host reaches (or fix /etc/hosts, whose 127.0.1.1 line maps this host's \
             own name to loopback)",
            resolved.join(", ")
        )
    })
}

/// The address of the interface the default route leaves by (IPv4, then IPv6), if not loopback.
fn default_route() -> Option<IpAddr> {
    // Documentation addresses (RFC 5737, RFC 3849): routed by the default route, never sent to.
    let v4 = SocketAddr::from((Ipv4Addr::new(192, 0, 2, 1), 9));
    let v6 = SocketAddr::from((Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1), 9));
    [v4, v6].into_iter().filter_map(route_to).find(|ip| !ip.is_loopback() && !ip.is_unspecified())
}

/// How long an accepted connection has to send its hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

impl Mesh {
    /// Connects every pair of ranks: rank i connects to every j < i and accepts from every j > i,
    /// all by `deadline` (the group bootstrap's, which began `ctx.opts.timeout` before it).
    pub(crate) fn connect(ctx: &Ctx, deadline: Instant) -> Result<Mesh> {
        let (rank, world) = (ctx.rank, ctx.world);
        let mut socks: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(Mesh {
                ctx: ctx.clone(),
                socks,
                aborted: false,
                budget: SpinBudget::new(),
            });
        }
        let boot_err = |reason: String| CommError::Bootstrap {
            prefix: ctx.prefix.clone(),
            reason,
        };
        let ip = advertise_addr(ctx.opts.advertise_addr, ctx.multi_host).map_err(boot_err)?;
        let bind_ip = match ip {
            ip if ip.is_loopback() => ip,
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let listener = TcpListener::bind((bind_ip, 0))
            .map_err(|e| CommError::io("binding the collective listener", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| CommError::io("listener address", e))?
            .port();
        let me = SocketAddr::new(ip, port);
        // A connection must name this listener's random token, which only this group's ranks
        // read from the store: a rank of another job that reached this port (its own peer's,
        // since reused) is turned away, whatever prefix the two jobs chose.
        let token = random_token();
        ctx.store.set(
            &format!("{}/tcp/{rank}", ctx.prefix),
            format!("{me} {token:016x}").as_bytes(),
        )?;

        for (j, slot) in socks.iter_mut().enumerate().take(rank) {
            let key = format!("{}/tcp/{j}", ctx.prefix);
            let left = deadline.saturating_duration_since(Instant::now());
            // A peer that never publishes its address is named (and blamed), not only its key.
            let raw = ctx.store.get(&key, left).map_err(|e| match e {
                CommError::StoreTimeout { .. } => CommError::Timeout {
                    peer: ctx.names[j],
                    op: format!("bootstrap (its address, store key {key})"),
                    waited_ms: ctx.opts.timeout.as_millis() as u64,
                },
                e => e,
            })?;
            let text = String::from_utf8_lossy(&raw);
            let bad = |why: String| boot_err(format!("bad address {text:?} for rank {}: {why}", ctx.names[j]));
            let (addr, token) = text.split_once(' ').ok_or_else(|| bad("expected ADDR TOKEN".into()))?;
            let addr: SocketAddr = addr.parse().map_err(|e| bad(format!("{e}")))?;
            let token = u64::from_str_radix(token, 16).map_err(|e| bad(format!("token: {e}")))?;
            let mut stream = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(CommError::Timeout {
                        peer: ctx.names[j],
                        op: "connect".into(),
                        waited_ms: ctx.opts.timeout.as_millis() as u64,
                    });
                }
                match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
                    Ok(s) => break s,
                    Err(_) => std::thread::sleep(Duration::from_millis(20).min(left)),
                }
            };
            let mut hello = [0u8; 16];
            hello[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            hello[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
            hello[8..16].copy_from_slice(&token.to_le_bytes());
            stream
                .write_all(&hello)
                .map_err(|e| CommError::io(format!("handshake with rank {}", ctx.names[j]), e))?;
            // The peer answers once it took the hello. Anything else at that address (another
            // job's listener on a reused port, a server that is not rsrun) never does.
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let mut ack = [0u8; 1];
            let answered = stream.set_read_timeout(Some(left)).and_then(|()| stream.read_exact(&mut ack));
            if answered.is_err() || ack[0] != HELLO_ACK {
                return Err(boot_err(format!(
                    "rank {} at {addr} did not answer the handshake ({}): the address may now belong to another process",
                    ctx.names[j],
                    match answered {
                        Err(e) => e.to_string(),
                        Ok(()) => format!("answered {:#04x}", ack[0]),
                    }
                )));
            }
            *slot = Some(stream);
        }

        let mut missing = world - 1 - rank;
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io("listener nonblocking", e))?;
        while missing > 0 {
            match listener.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(|e| CommError::io("accepted socket", e))?;
                    // A real peer says hello as soon as it connects: a connection that stays
                    // silent (a port scan, a health check) is dropped after HELLO_TIMEOUT
                    // instead of holding up the peers queued behind it until the deadline.
                    let left = deadline
                        .saturating_duration_since(Instant::now())
                        .clamp(Duration::from_millis(1), HELLO_TIMEOUT);
                    s.set_read_timeout(Some(left))
                        .map_err(|e| CommError::io("accepted socket", e))?;
                    let mut hello = [0u8; 16];
                    if s.read_exact(&mut hello).is_err() {
                        continue; // a stray or dead connection; keep waiting for the real peers
                    }
                    let magic = u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]);
                    let from =
                        u32::from_le_bytes([hello[4], hello[5], hello[6], hello[7]]) as usize;
                    let mut t = [0u8; 8];
                    t.copy_from_slice(&hello[8..16]);
                    if magic != MAGIC
                        || u64::from_le_bytes(t) != token
                        || from <= rank
                        || from >= world
                        || socks[from].is_some()
                    {
                        continue;
                    }
                    if s.write_all(&[HELLO_ACK]).is_err() {
                        continue; // the peer went away; it fails on its side
                    }
                    socks[from] = Some(s);
                    missing -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let peer = (rank + 1..world)
                            .find(|j| socks[*j].is_none())
                            .unwrap_or(rank);
                        return Err(CommError::Timeout {
                            peer: ctx.names[peer],
                            op: "accept".into(),
                            waited_ms: ctx.opts.timeout.as_millis() as u64,
                        });
                    }
                    poll_fds(
                        &mut [libc::pollfd {
                            fd: listener.as_raw_fd(),
                            events: libc::POLLIN,
                            revents: 0,
                        }],
                        Duration::from_millis(50),
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(CommError::io("accepting peer connections", e)),
            }
        }
        for s in socks.iter().flatten() {
            s.set_read_timeout(None)
                .map_err(|e| CommError::io("socket setup", e))?;
            set_sock_opts(s)?;
            s.set_nonblocking(true)
                .map_err(|e| CommError::io("socket setup", e))?;
        }
        Ok(Mesh {
            ctx: ctx.clone(),
            socks,
            aborted: false,
            budget: SpinBudget::new(),
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.ctx.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.ctx.world
    }

    pub(crate) fn ctx(&self) -> &Ctx {
        &self.ctx
    }

    fn sock(&self, peer: usize) -> Result<&TcpStream> {
        sock_of(&self.socks, self.ctx.world, peer)
    }

    /// The error for any op on a group that has aborted.
    fn refuse_if_aborted(&self, op: &str) -> Result<()> {
        if self.aborted {
            return Err(CommError::PeerFailed {
                peer: self.ctx.names[self.ctx.rank],
                op: op.into(),
                detail: "group already aborted".into(),
            });
        }
        Ok(())
    }

    /// The error for a connection to `peer` that failed: if `peer` aborted the group itself
    /// (it published a reason in the store), report the rank it blamed.
    pub(crate) fn peer_error(&self, peer: usize, op: &str, detail: String) -> CommError {
        self.peer_error_within(peer, op, detail, Duration::from_millis(300))
    }

    fn peer_error_within(
        &self,
        peer: usize,
        op: &str,
        detail: String,
        grace: Duration,
    ) -> CommError {
        let key = abort_key(&self.ctx.prefix, peer);
        let wait = grace.min(self.ctx.opts.timeout);
        if let Ok(Some(v)) = try_get(&*self.ctx.store, &key, wait) {
            let s = String::from_utf8_lossy(&v).to_string();
            let (origin, why) = s.split_once('\n').unwrap_or(("", s.as_str()));
            if let Ok(origin) = origin.parse::<usize>() {
                return CommError::Aborted {
                    by: self.ctx.names[peer],
                    origin,
                    detail: why.to_string(),
                };
            }
        }
        CommError::PeerFailed {
            peer: self.ctx.names[peer],
            op: op.to_string(),
            detail,
        }
    }

    /// Publishes why this rank gives up and closes every connection, so blocked peers fail fast.
    pub(crate) fn abort(&mut self, err: &CommError) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        let origin = err.peer().unwrap_or(self.ctx.names[self.ctx.rank]);
        let key = abort_key(&self.ctx.prefix, self.ctx.rank);
        // Best effort: the store may itself be gone.
        let _ = self
            .ctx
            .store
            .set(&key, format!("{origin}\n{err}").as_bytes());
        for s in self.socks.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Drives `sends` and `recvs` to completion. Operations on the same peer run in list order.
    /// `on_seg` is called for every `seg`-byte piece of a slice receive as soon as it arrives
    /// (and for the final partial piece).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &mut self,
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        seg: usize,
        on_seg: &mut OnSegment<'_>,
        deadline: Instant,
        op: &str,
        traffic: &mut Traffic,
    ) -> Result<()> {
        let seg = seg.max(1);
        self.refuse_if_aborted(op)?;
        loop {
            let mut progressed = false;
            let mut all_done = true;
            // Both directions busy: alternate in small steps (see `SEND_BURST`); one
            // direction alone moves as much as the kernel takes per call.
            let two_way =
                sends.iter().any(|s| s.done < s.data.len()) && recvs.iter().any(|r| !r.complete());
            let burst = if two_way { SEND_BURST } else { usize::MAX };
            let mut pending_send_peers: Vec<usize> = Vec::new();
            for s in sends.iter_mut() {
                if s.done == s.data.len() {
                    continue;
                }
                all_done = false;
                if pending_send_peers.contains(&s.peer) {
                    continue;
                }
                pending_send_peers.push(s.peer);
                let sock = self.sock(s.peer)?;
                loop {
                    let end = s.data.len().min(s.done.saturating_add(burst));
                    let write = || (&*sock).write(&s.data[s.done..end]);
                    let n = self.moved(write, s.peer, op, "connection closed")?;
                    if n == 0 {
                        break;
                    }
                    s.done += n;
                    traffic.sent += n as u64;
                    progressed = true;
                    if two_way || s.done == s.data.len() {
                        break;
                    }
                }
            }
            let mut pending_recv_peers: Vec<usize> = Vec::new();
            for (idx, r) in recvs.iter_mut().enumerate() {
                if r.complete() {
                    continue;
                }
                all_done = false;
                if pending_recv_peers.contains(&r.peer) {
                    continue;
                }
                pending_recv_peers.push(r.peer);
                let sock = self.sock(r.peer)?;
                loop {
                    if let Target::Framed {
                        len,
                        len_got,
                        max,
                        body: None,
                    } = &mut r.target
                    {
                        let read = || (&*sock).read(&mut len[*len_got..]);
                        let n = self.moved(read, r.peer, op, CLOSED_BY_PEER)?;
                        if n == 0 {
                            break;
                        }
                        progressed = true;
                        *len_got += n;
                        if *len_got == 8 {
                            let l = u64::from_le_bytes(*len);
                            let max = *max;
                            let Some(l) = usize::try_from(l).ok().filter(|l| *l <= max) else {
                                return Err(self.peer_error(
                                    r.peer,
                                    op,
                                    format!("bad frame length {l}: at most {max} bytes expected (another protocol or a corrupt stream)"),
                                ));
                            };
                            r.target = Target::Framed {
                                len: [0; 8],
                                len_got: 8,
                                max,
                                body: Some(vec![0u8; l]),
                            };
                        }
                        continue;
                    }
                    let slice = matches!(r.target, Target::Slice(_));
                    let ring = matches!(r.target, Target::Ring { .. });
                    // The next read lands in `dst[lo..hi]`, which holds stream bytes
                    // `base + lo..base + hi`.
                    let (dst, base, hi): (&mut [u8], usize, usize) = match &mut r.target {
                        Target::Slice(b) => {
                            let end =
                                ((r.done / seg).saturating_add(1).saturating_mul(seg)).min(b.len());
                            (&mut b[..], 0, end)
                        }
                        Target::Ring { slot, total } => {
                            let l = slot.len().max(1);
                            let start = r.done / l * l;
                            let end = (*total - start).min(slot.len());
                            (&mut slot[..], start, end)
                        }
                        Target::Framed { body: Some(b), .. } => {
                            let end = b.len();
                            (&mut b[..], 0, end)
                        }
                        Target::Framed { body: None, .. } => break,
                    };
                    let lo = r.done - base;
                    if lo >= hi {
                        break;
                    }
                    let n = self.moved(
                        || (&*sock).read(&mut dst[lo..hi]),
                        r.peer,
                        op,
                        CLOSED_BY_PEER,
                    )?;
                    if n == 0 {
                        break;
                    }
                    progressed = true;
                    r.done += n;
                    traffic.recv += n as u64;
                    // Hand completed segments to the callback.
                    let done_to = if slice && r.done == dst.len() {
                        r.done
                    } else if slice {
                        r.done / seg * seg
                    } else if ring && r.done == base + hi {
                        r.done
                    } else {
                        r.notified
                    };
                    if done_to > r.notified {
                        let range = r.notified..done_to;
                        on_seg(
                            idx,
                            range.clone(),
                            &dst[range.start - base..range.end - base],
                        )?;
                        r.notified = done_to;
                    }
                    if two_way {
                        break;
                    }
                }
            }
            if all_done {
                return Ok(());
            }
            if progressed {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                let peer = recvs
                    .iter()
                    .find(|r| !r.complete())
                    .map(|r| r.peer)
                    .or_else(|| sends.iter().find(|s| s.done < s.data.len()).map(|s| s.peer))
                    .unwrap_or(self.ctx.rank);
                return Err(self.timed_out(peer, op));
            }
            let mut fds: Vec<libc::pollfd> = Vec::new();
            let mut add = |fd: i32, ev: libc::c_short| {
                if let Some(p) = fds.iter_mut().find(|p| p.fd == fd) {
                    p.events |= ev;
                } else {
                    fds.push(libc::pollfd {
                        fd,
                        events: ev,
                        revents: 0,
                    });
                }
            };
            for p in &pending_send_peers {
                add(self.sock(*p)?.as_raw_fd(), libc::POLLOUT);
            }
            for p in &pending_recv_peers {
                add(self.sock(*p)?.as_raw_fd(), libc::POLLIN);
            }
            poll_fds(&mut fds, (deadline - now).min(Duration::from_millis(100)));
        }
    }

    /// Runs one two-way byte stream with `peer` whose contents are decided as it goes (see
    /// [`Duplex`]): each pass makes at most one write (of at most [`SEND_BURST`] bytes) and one
    /// read, and waits in `poll` only when neither side can move.
    ///
    /// # Errors
    /// A peer failure, `deadline` passing, or an error from `io`.
    pub(crate) fn duplex(
        &mut self,
        peer: usize,
        io: &mut dyn Duplex,
        deadline: Instant,
        op: &str,
        traffic: &mut Traffic,
    ) -> Result<()> {
        self.refuse_if_aborted(op)?;
        // Borrows only the sockets, so that the spin budget below can be updated meanwhile.
        let sock = sock_of(&self.socks, self.ctx.world, peer)?;
        // When the current stall began (neither direction could move).
        let mut stalled: Option<Instant> = None;
        loop {
            let mut progressed = false;
            let want_out = match io.outgoing() {
                Some(data) if !data.is_empty() => {
                    let data = &data[..data.len().min(SEND_BURST)];
                    let n = self.moved(|| (&*sock).write(data), peer, op, "connection closed")?;
                    if n > 0 {
                        traffic.sent += n as u64;
                        progressed = true;
                        io.sent(n);
                    }
                    true
                }
                // Nothing ready to send yet (it waits on data still to arrive) or all sent.
                _ => false,
            };
            let want_in = match io.incoming() {
                Some(dst) if !dst.is_empty() => {
                    let n = self.moved(|| (&*sock).read(dst), peer, op, CLOSED_BY_PEER)?;
                    if n > 0 {
                        traffic.recv += n as u64;
                        progressed = true;
                        io.received(n)?;
                    }
                    true
                }
                _ => false,
            };
            if io.finished() {
                return Ok(());
            }
            if progressed {
                if let Some(t0) = stalled.take() {
                    self.budget.record(WaitKind::Step, t0.elapsed());
                }
                continue;
            }
            // Stalls inside the exchange last about one segment's transfer: spin for a budget
            // proportional to the recent ones before sleeping in `poll` (whose wake-up costs
            // tens of microseconds per segment otherwise).
            let t0 = *stalled.get_or_insert_with(Instant::now);
            if t0.elapsed() < self.budget.spin_for(WaitKind::Step, self.ctx.opts.spin) {
                std::hint::spin_loop();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.timed_out(peer, op));
            }
            let mut events: libc::c_short = 0;
            if want_out {
                events |= libc::POLLOUT;
            }
            if want_in {
                events |= libc::POLLIN;
            }
            if events == 0 {
                // Unfinished, yet nothing to send and nothing to receive: a bug in `io`.
                return Err(CommError::InvalidArgument(format!(
                    "{op}: the exchange with rank {peer} stalled with nothing left to send or receive"
                )));
            }
            let mut fds = [libc::pollfd {
                fd: sock.as_raw_fd(),
                events,
                revents: 0,
            }];
            poll_fds(&mut fds, (deadline - now).min(Duration::from_millis(100)));
        }
    }

    /// The error for an op whose deadline passed while waiting on `peer`: the root cause, found
    /// by following who waited on whom.
    ///
    /// This rank first says whom it waited on (`waits/<rank>`), at once. Then it follows the
    /// chain from `peer`: a rank that aborted names its root cause (that abort is the answer); a
    /// rank that said whom it waited on passes the question on; the rank at the end, which says
    /// nothing within the grace, is the one that stopped. Without the chain, a rank that timed out
    /// on a neighbour blocked behind the stopped rank raced that neighbour's own grace, and named
    /// the neighbour. A loop (ranks waiting on each other: mismatched calls) names `peer`.
    fn timed_out(&self, peer: usize, op: &str) -> CommError {
        let waits = |r: usize| format!("{}/waits/{r}", self.ctx.prefix);
        // Best effort: the store may itself be gone.
        let _ = self.ctx.store.set(&waits(self.ctx.rank), peer.to_string().as_bytes());
        // (Staged algorithms time out one stage after another: at least 1 s, at most 10 s.)
        let grace = (self.ctx.opts.timeout / 10).clamp(Duration::from_secs(1), Duration::from_secs(10));
        let until = Instant::now() + grace;
        let poll = Duration::from_millis(50);
        let mut chain = vec![self.ctx.rank, peer];
        let mut at = peer;
        // Every hop within the one grace: a long chain (a big ring) reports in time too.
        while Instant::now() < until {
            if let e @ CommError::Aborted { .. } = self.peer_error_within(at, op, String::new(), Duration::ZERO) {
                return e;
            }
            match try_get(&*self.ctx.store, &waits(at), poll) {
                Ok(Some(v)) => match String::from_utf8_lossy(&v).parse::<usize>() {
                    Ok(next) if next < self.ctx.names.len() && !chain.contains(&next) => {
                        chain.push(next);
                        at = next;
                        continue;
                    }
                    // A loop: the ranks wait on each other, none of them stopped.
                    _ => {
                        at = peer;
                        break;
                    }
                },
                Ok(None) => {}
                Err(_) => break,
            }
        }
        if at != peer {
            let names: Vec<String> = chain.iter().map(|&r| self.ctx.names[r].to_string()).collect();
            tracing::warn!(chain = %names.join(" -> "), "{op} timed out behind rank {}", self.ctx.names[at]);
        }
        CommError::Timeout {
            peer: self.ctx.names[at],
            op: op.to_string(),
            waited_ms: self.ctx.opts.timeout.as_millis() as u64,
        }
    }

    /// Bytes moved by one non-blocking `read`/`write` with `peer` (`io`, retried when
    /// interrupted): 0 when it would block; a zero-byte result (the peer closed; `io` is never
    /// given an empty buffer) is the error `closed`.
    fn moved(
        &self,
        mut io: impl FnMut() -> std::io::Result<usize>,
        peer: usize,
        op: &str,
        closed: &str,
    ) -> Result<usize> {
        loop {
            match io() {
                Ok(0) => return Err(self.peer_error(peer, op, closed.into())),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.peer_error(peer, op, e.to_string())),
            }
        }
    }

    /// Sends and receives without segment callbacks.
    pub(crate) fn run_plain(
        &mut self,
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        op: &str,
        traffic: &mut Traffic,
    ) -> Result<()> {
        self.run(
            sends,
            recvs,
            usize::MAX,
            &mut |_, _, _| Ok(()),
            deadline,
            op,
            traffic,
        )
    }

    /// All-gather of variable-length blobs of at most `max_blob` bytes each in ceil(log2 N)
    /// rounds (Bruck's algorithm). Returns the blobs indexed by group rank.
    pub(crate) fn bruck_allgather(
        &mut self,
        mine: Vec<u8>,
        max_blob: usize,
        deadline: Instant,
        op: &str,
    ) -> Result<Vec<Vec<u8>>> {
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let mut held: Vec<Vec<u8>> = vec![mine]; // held[k] is the blob of rank (r + k) % n
        let mut dist = 1;
        let mut ignore = Traffic::default();
        while dist < n {
            let cnt = dist.min(n - dist);
            let mut msg = Vec::new();
            for b in &held[..cnt] {
                msg.extend_from_slice(&(b.len() as u64).to_le_bytes());
                msg.extend_from_slice(b);
            }
            let msg = frame(&msg);
            let to = (r + n - dist) % n;
            let from = (r + dist) % n;
            let mut sends = [SendOp::new(to, &msg)];
            let max = cnt.saturating_mul(max_blob.saturating_add(8));
            let mut recvs = [RecvOp::framed(from, max)];
            self.run_plain(&mut sends, &mut recvs, deadline, op, &mut ignore)?;
            let [rv] = recvs;
            let body = rv.into_body();
            let mut off = 0;
            for _ in 0..cnt {
                if off + 8 > body.len() {
                    return Err(self.peer_error(from, op, "truncated message".into()));
                }
                let mut l = [0u8; 8];
                l.copy_from_slice(&body[off..off + 8]);
                let l = u64::from_le_bytes(l) as usize;
                off += 8;
                // `off` is at most the body's length here; a garbled length cannot overflow.
                if l > body.len() - off || l > max_blob {
                    return Err(self.peer_error(from, op, "truncated message".into()));
                }
                held.push(body[off..off + l].to_vec());
                off += l;
            }
            dist *= 2;
        }
        let mut out = vec![Vec::new(); n];
        for (k, b) in held.into_iter().enumerate().take(n) {
            out[(r + k) % n] = b;
        }
        Ok(out)
    }
}

/// `poll(2)` with a bounded timeout; errors (EINTR) are treated as a wake-up.
pub(crate) fn poll_fds(fds: &mut [libc::pollfd], timeout: Duration) {
    let ms = timeout.as_millis().clamp(0, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, exclusively borrowed array of pollfd of the given length.
    unsafe {
        libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms);
    }
}

#[cfg(test)]
mod handshake_tests {
    use super::*;
    use crate::comm::{CommOptions, LocalStore, Store};
    use std::sync::Arc;

    fn ctx(rank: usize, store: Arc<dyn Store>) -> Ctx {
        Ctx {
            rank,
            world: 2,
            names: Arc::new(vec![0, 1]),
            store,
            prefix: "hs".into(),
            opts: CommOptions { timeout: Duration::from_secs(3), ..CommOptions::default() },
            multi_host: false,
        }
    }

    #[test]
    fn a_group_across_hosts_never_advertises_a_name_that_resolves_to_loopback() {
        // One host: as resolved, loopback included.
        assert!(advertise_from(Some("localhost"), false).unwrap().is_loopback());
        assert_eq!(advertise_from(None, true).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        // A loopback IP given as such is meant (tests simulating hosts on one machine).
        assert_eq!(advertise_from(Some("127.0.0.1"), true).unwrap(), IpAddr::V4(Ipv4Addr::LOCALHOST));
        // A name resolving to loopback only, across hosts: the default route's interface, or an
        // error naming the name and what it resolved to (never loopback).
        match advertise_from(Some("localhost"), true) {
            Ok(ip) => {
                assert!(!ip.is_loopback(), "{ip}");
                assert_eq!(Some(ip), default_route());
            }
            Err(e) => {
                assert!(default_route().is_none());
                assert!(e.contains("MASTER_ADDR=\"localhost\" resolves here to loopback only"), "{e}");
            }
        }
    }

    /// The socket buffers are fixed at SOCK_BUF only where the kernel's caps allow all of it;
    /// elsewhere the kernel's autotuning is left on (a fixed size under the cap would pin the
    /// window at a few hundred KiB between hosts).
    #[test]
    fn socket_buffers_are_fixed_only_where_the_cap_allows_them() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        set_sock_opts(&s).unwrap();
        let get = |opt: libc::c_int| {
            let mut v: libc::c_int = 0;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: an open socket; the value and its length are a c_int on our stack.
            let rc = unsafe { libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, opt, (&mut v as *mut libc::c_int).cast(), &mut len) };
            assert_eq!(rc, 0);
            v
        };
        let cap = |name: &str| std::fs::read_to_string(format!("/proc/sys/net/core/{name}")).ok().and_then(|t| t.trim().parse::<u64>().ok());
        for (i, (opt, name)) in [(libc::SO_SNDBUF, "wmem_max"), (libc::SO_RCVBUF, "rmem_max")].into_iter().enumerate() {
            let fixed = cap(name).is_some_and(|m| m >= SOCK_BUF as u64);
            assert_eq!(sock_buf_allowed()[i], fixed);
            // The kernel reports twice the size set (its bookkeeping overhead).
            assert_eq!(get(opt) == 2 * SOCK_BUF, fixed, "{name}: cap {:?}, buffer {}", cap(name), get(opt));
        }
    }

    /// A bootstrap deadline 3 s from now (the timeout of `ctx`).
    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(3)
    }

    /// A rank whose peer's address now belongs to a process that takes the connection but
    /// never answers the handshake (another job's listener on a reused port, any other server)
    /// says so, naming the rank and the address, instead of sending it gradients.
    #[test]
    fn an_address_that_does_not_answer_the_handshake_is_named() {
        let store: Arc<dyn Store> = Arc::new(LocalStore::new());
        let stranger = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = stranger.local_addr().unwrap();
        std::thread::spawn(move || {
            // Takes connections and reads what comes, answering nothing.
            for s in stranger.incoming().flatten() {
                std::thread::spawn(move || std::io::copy(&mut &s, &mut std::io::sink()));
            }
        });
        store.set("hs/tcp/0", format!("{addr} {:016x}", 7u64).as_bytes()).unwrap();
        let err = Mesh::connect(&ctx(1, store), soon()).err().expect("a handshake nobody answered").to_string();
        assert!(err.contains(&format!("rank 0 at {addr} did not answer the handshake")), "{err}");
    }

    /// Two real ranks connect; a connection that names another token is turned away and the
    /// real peer still gets in.
    #[test]
    fn a_hello_with_another_token_is_refused_and_the_real_peer_connects() {
        let store: Arc<dyn Store> = Arc::new(LocalStore::new());
        let s0 = store.clone();
        let rank0 = std::thread::spawn(move || Mesh::connect(&ctx(0, s0), soon()).map(|m| m.socks.iter().flatten().count()));
        let raw = store.get("hs/tcp/0", Duration::from_secs(3)).unwrap();
        let addr: SocketAddr = String::from_utf8_lossy(&raw).split(' ').next().unwrap().parse().unwrap();
        // An intruder with the right magic and rank but a guessed token: no answer, then closed.
        let mut intruder = TcpStream::connect(addr).unwrap();
        let mut hello = [0u8; 16];
        hello[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        hello[4..8].copy_from_slice(&1u32.to_le_bytes());
        hello[8..16].copy_from_slice(&7u64.to_le_bytes());
        intruder.write_all(&hello).unwrap();
        intruder.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut ack = [0u8; 1];
        assert_eq!(intruder.read(&mut ack).unwrap_or(0), 0, "the intruder was answered");
        let rank1 = Mesh::connect(&ctx(1, store), soon()).unwrap();
        assert_eq!(rank1.socks.iter().flatten().count(), 1);
        assert_eq!(rank0.join().unwrap().unwrap(), 1);
    }
}
