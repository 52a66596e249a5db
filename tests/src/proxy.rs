//! A user-space TCP proxy for partitions between two processes on loopback (this kernel has no
//! netem; etcd's robustness tests use the same kind of proxy): every connection to
//! [`Proxy::addr`] is forwarded to the target, and the link can be cut in three ways:
//!
//! - [`Fault::Blackhole`]: bytes are held, in both directions, until the fault is lifted (a
//!   partition that heals: nothing is lost, everything is late); new connections are accepted and
//!   held the same way;
//! - [`Fault::Delay`]: every chunk is forwarded after the given delay;
//! - [`Fault::Drop`]: every connection is reset and new ones are closed at once (a crash of the
//!   path).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the link does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything.
    None,
    /// Hold everything until lifted.
    Blackhole,
    /// Forward after this delay.
    Delay(Duration),
    /// Reset every connection; refuse new ones.
    Drop,
}

#[derive(Debug)]
struct Shared {
    fault: Mutex<Fault>,
    conns: Mutex<Vec<TcpStream>>,
    stop: AtomicBool,
}

/// A proxy listening on 127.0.0.1 (a free port), stopped on drop.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Proxy {
    /// Starts forwarding to `target`.
    pub fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared { fault: Mutex::new(Fault::None), conns: Mutex::new(Vec::new()), stop: AtomicBool::new(false) });
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = conn else { continue };
                if s.fault() == Fault::Drop {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(target) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                {
                    let mut conns = s.conns.lock().unwrap_or_else(|p| p.into_inner());
                    conns.push(client.try_clone().expect("clone"));
                    conns.push(server.try_clone().expect("clone"));
                }
                for (from, to) in [(client.try_clone().expect("clone"), server.try_clone().expect("clone")), (server, client)] {
                    let s = s.clone();
                    std::thread::spawn(move || pump(from, to, &s));
                }
            }
        });
        Proxy { addr, shared }
    }

    /// Where to connect instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets the fault (`Fault::None` heals).
    pub fn set(&self, fault: Fault) {
        *self.shared.fault.lock().unwrap_or_else(|p| p.into_inner()) = fault;
        if fault == Fault::Drop {
            for c in self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
    }
}

impl Shared {
    fn fault(&self) -> Fault {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, s: &Shared) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        loop {
            match s.fault() {
                Fault::None => break,
                Fault::Delay(d) => {
                    std::thread::sleep(d);
                    break;
                }
                Fault::Blackhole => {
                    if s.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Fault::Drop => {
                    let _ = from.shutdown(Shutdown::Both);
                    let _ = to.shutdown(Shutdown::Both);
                    return;
                }
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.set(Fault::Drop);
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr);
    }
}
