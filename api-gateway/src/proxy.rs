//! The client's real address behind a reverse proxy. The operator names the proxies it
//! runs (`--trusted-proxies`, addresses or CIDRs); only a connection from one of them may
//! say, in `X-Forwarded-For`, whom it forwards for. Any other peer's header is ignored:
//! a client that could name its own address could spread its anonymous requests over
//! made-up addresses, or charge them to someone else's.
//!
//! `X-Forwarded-For` is read from the right (each proxy appends the address it received
//! the request from): the client is the first entry, from the right, that is not itself
//! a trusted proxy. A header that is missing or garbled leaves the last trusted hop as
//! the address, so a broken proxy chain shares one budget instead of escaping it.

use axum::http::HeaderMap;
use std::net::IpAddr;
use std::str::FromStr;

/// An address or a network (`10.0.0.0/8`, `fd00::/8`, `192.0.2.7`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    bits: u8,
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (addr, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let net: IpAddr = addr.parse().map_err(|_| format!("{s:?} is not an IP address or CIDR"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(b) => b.parse::<u8>().ok().filter(|&b| b <= max).ok_or_else(|| format!("{s:?}: the prefix length must be 0 to {max}"))?,
        };
        Ok(Cidr { net, bits })
    }
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        // An IPv4 peer may arrive as an IPv4-mapped IPv6 address on a dual-stack socket.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => mask(u32::from(n) as u128, u32::from(a) as u128, 32, self.bits),
            (IpAddr::V6(n), IpAddr::V6(a)) => mask(u128::from(n), u128::from(a), 128, self.bits),
            _ => false,
        }
    }
}

fn mask(net: u128, addr: u128, width: u8, bits: u8) -> bool {
    if bits == 0 {
        return true;
    }
    let shift = width - bits;
    (net >> shift) == (addr >> shift)
}

/// The proxies whose `X-Forwarded-For` is believed (none by default).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<Cidr>);

impl TrustedProxies {
    /// Parses the flag's entries; empty entries are skipped.
    pub fn parse(entries: &[String]) -> Result<TrustedProxies, String> {
        entries.iter().filter(|e| !e.trim().is_empty()).map(|e| e.parse()).collect::<Result<_, _>>().map(TrustedProxies)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|c| c.contains(ip))
    }

    /// The client's address: `peer` itself unless `peer` is a trusted proxy, then the
    /// nearest untrusted hop that `X-Forwarded-For` names.
    pub fn client_address(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if !self.trusts(peer) {
            return peer;
        }
        // Several headers are one list, in order.
        let hops: Vec<&str> = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .collect();
        let mut client = peer;
        for hop in hops.iter().rev() {
            if !self.trusts(client) {
                break;
            }
            match parse_hop(hop) {
                Some(ip) => client = ip,
                None => break,
            }
        }
        client
    }
}

/// One `X-Forwarded-For` entry: an address, possibly with a port (`1.2.3.4:80`,
/// `[::1]:80`).
fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    if let Ok(ip) = hop.parse() {
        return Some(ip);
    }
    if let Some(rest) = hop.strip_prefix('[') {
        return rest.split_once(']').and_then(|(a, _)| a.parse().ok());
    }
    hop.rsplit_once(':').and_then(|(a, p)| p.bytes().all(|b| b.is_ascii_digit()).then_some(a)).and_then(|a| a.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(xff: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in xff {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cidrs_parse_and_match() {
        let c: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(c.contains(ip("10.1.2.3")) && !c.contains(ip("11.0.0.1")));
        assert!(c.contains(ip("::ffff:10.9.9.9")), "IPv4-mapped");
        let one: Cidr = "192.0.2.7".parse().unwrap();
        assert!(one.contains(ip("192.0.2.7")) && !one.contains(ip("192.0.2.8")));
        assert!("fd00::/8".parse::<Cidr>().unwrap().contains(ip("fd12::1")));
        assert!("0.0.0.0/0".parse::<Cidr>().unwrap().contains(ip("8.8.8.8")));
        for bad in ["10.0.0.0/33", "nonsense", "10.0.0/8", "::/129"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn only_a_trusted_peer_names_the_client() {
        let t = TrustedProxies::parse(&["10.0.0.0/8".into()]).unwrap();
        // An untrusted peer's header is ignored.
        assert_eq!(t.client_address(ip("203.0.113.5"), &headers(&["1.1.1.1"])), ip("203.0.113.5"));
        // Behind the proxy: the client the proxy saw, not what the client wrote before it.
        assert_eq!(t.client_address(ip("10.0.0.2"), &headers(&["6.6.6.6, 198.51.100.9"])), ip("198.51.100.9"));
        // Two trusted hops, over two headers.
        assert_eq!(t.client_address(ip("10.0.0.2"), &headers(&["198.51.100.9:4711", "10.0.0.3"])), ip("198.51.100.9"));
        // Missing or garbled: the proxy's own address.
        assert_eq!(t.client_address(ip("10.0.0.2"), &headers(&[])), ip("10.0.0.2"));
        assert_eq!(t.client_address(ip("10.0.0.2"), &headers(&["1.1.1.1, garbage"])), ip("10.0.0.2"));
        assert_eq!(t.client_address(ip("10.0.0.2"), &headers(&["[2001:db8::1]:443"])), ip("2001:db8::1"));
        // No trusted proxies: never read.
        assert_eq!(TrustedProxies::default().client_address(ip("10.0.0.2"), &headers(&["1.1.1.1"])), ip("10.0.0.2"));
    }
}
