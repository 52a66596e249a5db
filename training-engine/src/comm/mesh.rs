//! A full mesh of TCP connections and a poll-based progress engine that drives many
//! concurrent sends and receives (full duplex, no helper threads, every wait bounded).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::Ctx;
use super::error::{CommError, Result};
use super::op::Traffic;
use super::store::try_get;

const MAGIC: u32 = 0x5253_524e; // "RSRN"
/// Socket buffer size requested (the kernel caps it at net.core.{r,w}mem_max).
const SOCK_BUF: libc::c_int = 4 << 20;

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
    /// A message prefixed by its length (u64 little endian); the body is allocated on arrival.
    Framed {
        len: [u8; 8],
        len_got: usize,
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

    pub(crate) fn framed(peer: usize) -> RecvOp<'static> {
        RecvOp {
            peer,
            target: Target::Framed {
                len: [0; 8],
                len_got: 0,
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
            Target::Slice(_) => Vec::new(),
        }
    }

    fn total(&self) -> Option<usize> {
        match &self.target {
            Target::Slice(b) => Some(b.len()),
            Target::Framed { body, .. } => body.as_ref().map(|b| b.len()),
        }
    }

    fn complete(&self) -> bool {
        self.total() == Some(self.done)
    }
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

/// Full mesh of TCP connections between the ranks of one group.
pub(crate) struct Mesh {
    ctx: Ctx,
    socks: Vec<Option<TcpStream>>,
    aborted: bool,
}

fn set_sock_opts(s: &TcpStream) -> Result<()> {
    s.set_nodelay(true)
        .map_err(|e| CommError::io("setting TCP_NODELAY", e))?;
    let fd = s.as_raw_fd();
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
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

fn prefix_token(prefix: &str) -> u64 {
    // FNV-1a: enough to reject connections meant for another group.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in prefix.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The address peers should use to reach this process.
pub(crate) fn advertise_addr(opt: Option<IpAddr>) -> IpAddr {
    if let Some(a) = opt {
        return a;
    }
    // Learn the interface that routes to MASTER_ADDR (no packet is sent by a UDP connect).
    if let Ok(m) = std::env::var("MASTER_ADDR") {
        use std::net::ToSocketAddrs;
        if let Some(target) = (m.as_str(), 9)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
        {
            if target.ip().is_loopback() {
                return target.ip();
            }
            if let Ok(u) = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
                && u.connect(target).is_ok()
                && let Ok(local) = u.local_addr()
            {
                return local.ip();
            }
        }
    }
    IpAddr::V4(Ipv4Addr::LOCALHOST)
}

impl Mesh {
    /// Connects every pair of ranks: rank i connects to every j < i and accepts from every j > i.
    pub(crate) fn connect(ctx: &Ctx) -> Result<Mesh> {
        let (rank, world) = (ctx.rank, ctx.world);
        let mut socks: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(Mesh {
                ctx: ctx.clone(),
                socks,
                aborted: false,
            });
        }
        let boot_err = |reason: String| CommError::Bootstrap {
            prefix: ctx.prefix.clone(),
            reason,
        };
        let deadline = Instant::now() + ctx.opts.timeout;
        let ip = advertise_addr(ctx.opts.advertise_addr);
        let bind_ip = if ip.is_loopback() {
            ip
        } else {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        };
        let listener = TcpListener::bind((bind_ip, 0))
            .map_err(|e| CommError::io("binding the collective listener", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| CommError::io("listener address", e))?
            .port();
        let me = SocketAddr::new(ip, port);
        ctx.store.set(
            &format!("{}/tcp/{rank}", ctx.prefix),
            me.to_string().as_bytes(),
        )?;
        let token = prefix_token(&ctx.prefix);

        for (j, slot) in socks.iter_mut().enumerate().take(rank) {
            let key = format!("{}/tcp/{j}", ctx.prefix);
            let left = deadline.saturating_duration_since(Instant::now());
            let raw = ctx.store.get(&key, left)?;
            let addr: SocketAddr = String::from_utf8_lossy(&raw).parse().map_err(|e| {
                boot_err(format!(
                    "bad address {:?} for rank {}: {e}",
                    String::from_utf8_lossy(&raw),
                    ctx.names[j]
                ))
            })?;
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
                    let left = deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1));
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
        self.socks
            .get(peer)
            .and_then(|s| s.as_ref())
            .ok_or(CommError::InvalidRank {
                what: "peer",
                rank: peer,
                world: self.ctx.world,
            })
    }

    /// The error for a connection to `peer` that failed: if `peer` aborted the group itself
    /// (it published a reason in the store), report the rank it blamed.
    fn peer_error(&self, peer: usize, op: &str, detail: String) -> CommError {
        self.peer_error_within(peer, op, detail, Duration::from_millis(300))
    }

    fn peer_error_within(
        &self,
        peer: usize,
        op: &str,
        detail: String,
        grace: Duration,
    ) -> CommError {
        let key = format!("{}/abort/{peer}", self.ctx.prefix);
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
        let key = format!("{}/abort/{}", self.ctx.prefix, self.ctx.rank);
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
        if self.aborted {
            return Err(CommError::PeerFailed {
                peer: self.ctx.names[self.ctx.rank],
                op: op.into(),
                detail: "group already aborted".into(),
            });
        }
        loop {
            let mut progressed = false;
            let mut all_done = true;
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
                    match (&*sock).write(&s.data[s.done..]) {
                        Ok(0) => {
                            return Err(self.peer_error(s.peer, op, "connection closed".into()));
                        }
                        Ok(n) => {
                            s.done += n;
                            traffic.sent += n as u64;
                            progressed = true;
                            if s.done == s.data.len() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(self.peer_error(s.peer, op, e.to_string())),
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
                        body: None,
                    } = &mut r.target
                    {
                        match (&*sock).read(&mut len[*len_got..]) {
                            Ok(0) => {
                                return Err(self.peer_error(
                                    r.peer,
                                    op,
                                    "connection closed (peer exited or aborted)".into(),
                                ));
                            }
                            Ok(n) => {
                                progressed = true;
                                *len_got += n;
                                if *len_got == 8 {
                                    let l = u64::from_le_bytes(*len) as usize;
                                    if l > (1 << 34) {
                                        return Err(self.peer_error(
                                            r.peer,
                                            op,
                                            format!("bad frame length {l}"),
                                        ));
                                    }
                                    r.target = Target::Framed {
                                        len: [0; 8],
                                        len_got: 8,
                                        body: Some(vec![0u8; l]),
                                    };
                                }
                                continue;
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            Err(e) => return Err(self.peer_error(r.peer, op, e.to_string())),
                        }
                    }
                    let (buf, is_slice): (&mut [u8], bool) = match &mut r.target {
                        Target::Slice(b) => (&mut b[..], true),
                        Target::Framed { body: Some(b), .. } => (&mut b[..], false),
                        Target::Framed { body: None, .. } => break,
                    };
                    if r.done == buf.len() {
                        break;
                    }
                    let end = if is_slice {
                        ((r.done / seg).saturating_add(1).saturating_mul(seg)).min(buf.len())
                    } else {
                        buf.len()
                    };
                    match (&*sock).read(&mut buf[r.done..end]) {
                        Ok(0) => {
                            return Err(self.peer_error(
                                r.peer,
                                op,
                                "connection closed (peer exited or aborted)".into(),
                            ));
                        }
                        Ok(n) => {
                            progressed = true;
                            r.done += n;
                            traffic.recv += n as u64;
                            if is_slice {
                                let boundary = if r.done == buf.len() {
                                    r.done
                                } else {
                                    r.done / seg * seg
                                };
                                if boundary > r.notified {
                                    let range = r.notified..boundary;
                                    on_seg(idx, range.clone(), &buf[range])?;
                                    r.notified = boundary;
                                }
                            }
                            if r.done == buf.len() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(self.peer_error(r.peer, op, e.to_string())),
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
                // If that peer gave up first (it blames someone else), report the root cause.
                let timeout = CommError::Timeout {
                    peer: self.ctx.names[peer],
                    op: op.to_string(),
                    waited_ms: self.ctx.opts.timeout.as_millis() as u64,
                };
                // (Staged algorithms time out one stage after another: allow up to 1 s.)
                return Err(
                    match self.peer_error_within(peer, op, String::new(), Duration::from_secs(1)) {
                        e @ CommError::Aborted { .. } => e,
                        _ => timeout,
                    },
                );
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

    /// All-gather of variable-length blobs in ceil(log2 N) rounds (Bruck's algorithm).
    /// Returns the blobs indexed by group rank.
    pub(crate) fn bruck_allgather(
        &mut self,
        mine: Vec<u8>,
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
            let mut recvs = [RecvOp::framed(from)];
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
                if off + l > body.len() {
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
