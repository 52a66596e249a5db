//! Whether an address belongs to this machine.
//!
//! The interfaces' addresses (`getifaddrs`) and loopback decide. Binding a socket to the address
//! is no proof: with `net.ipv4.ip_nonlocal_bind=1` (usual on keepalived and load-balancer hosts)
//! every address binds, and a remote host's address taken for ours starts its agent here, or hosts
//! its rendezvous here.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Whether `ip` is loopback or assigned to one of this machine's interfaces. Where the interfaces
/// cannot be listed, whether a socket binds to it.
pub fn is_own_address(ip: IpAddr) -> bool {
    // `::ffff:10.0.0.5` (a dual-stack socket's view, a literal endpoint) is the IPv4 address the
    // interfaces list.
    let ip = ip.to_canonical();
    if ip.is_loopback() {
        return true;
    }
    match interface_addresses() {
        Some(own) => own.contains(&ip),
        None => std::net::UdpSocket::bind((ip, 0)).is_ok(),
    }
}

/// The addresses of this machine's interfaces, or `None` when `getifaddrs` fails.
pub fn interface_addresses() -> Option<Vec<IpAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that freeifaddrs releases below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is an element of the list getifaddrs returned, not yet freed.
        let entry = unsafe { &*cur };
        if !entry.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr whose family says which kind it is.
            let family = i32::from(unsafe { (*entry.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in>() };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
            } else if family == libc::AF_INET6 {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in6>() };
                out.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        cur = entry.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loopback and the machine's own interface addresses are ours; TEST-NET addresses are not,
    /// even where the kernel would let a socket bind them.
    #[test]
    fn own_addresses_come_from_the_interfaces() {
        assert!(is_own_address("127.0.0.1".parse().unwrap()));
        assert!(is_own_address("127.0.0.2".parse().unwrap()));
        assert!(is_own_address("::1".parse().unwrap()));
        assert!(is_own_address("::ffff:127.0.0.1".parse().unwrap()), "an IPv4-mapped loopback");
        assert!(!is_own_address("::ffff:192.0.2.7".parse().unwrap()));
        let own = interface_addresses().expect("getifaddrs");
        assert!(own.iter().any(|a| a.is_loopback()), "{own:?}");
        for a in &own {
            assert!(is_own_address(*a), "{a}");
        }
        for stranger in ["192.0.2.77", "198.51.100.3", "2001:db8::5"] {
            assert!(!is_own_address(stranger.parse().unwrap()), "{stranger}");
        }
    }
}
