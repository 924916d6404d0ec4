//! The run's proxy URL as the proxy gives it (`http://<run>:<secret>@<addr>`):
//! the address and port it names (the relay's upstream, Landlock's TCP port
//! without a namespace), and the URL a confined child gets instead, its
//! credential with the in-namespace listener as the host.

use crate::confine::netns::CHILD_PROXY;

/// The proxy URL a confined child gets: the run's credential, with the host
/// part replaced by the in-namespace listener.
pub fn for_child(run_url: &str) -> String {
    let (scheme, rest) = run_url.split_once("://").unwrap_or(("http", run_url));
    let creds = rest.rsplit_once('@').map(|(c, _)| c);
    match creds {
        Some(c) => format!("{scheme}://{c}@{CHILD_PROXY}"),
        None => format!("{scheme}://{CHILD_PROXY}"),
    }
}

/// The port of a run's proxy URL, also when it names a host (a cell's
/// `advertise_proxy`): what Landlock lets a child without its own network
/// namespace connect to.
pub fn port(run_url: &str) -> Option<u16> {
    let rest = run_url.split_once("://").map_or(run_url, |(_, r)| r);
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host.split('/').next().unwrap_or(host);
    host.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// The proxy's data address from a run's proxy URL (an IP literal; never
/// resolved).
pub fn addr(run_url: &str) -> Option<std::net::SocketAddr> {
    let rest = run_url.split_once("://").map_or(run_url, |(_, r)| r);
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host.split('/').next().unwrap_or(host);
    host.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxy_port_is_read_from_a_name_too() {
        assert_eq!(port("http://r:s@cell-a.cells.example:3128"), Some(3128));
        assert_eq!(port("http://r:s@127.0.0.1:9"), Some(9));
        assert_eq!(port("http://r:s@[::1]:7"), Some(7));
        assert_eq!(port("http://r:s@cell-a"), None);
    }

    #[test]
    fn child_proxy_url_keeps_the_credential() {
        assert_eq!(
            for_child("http://run-1:s3cret@127.0.0.1:9"),
            "http://run-1:s3cret@127.0.0.1:3128"
        );
        assert_eq!(
            addr("http://run-1:s3cret@127.0.0.1:9/").map(|a| a.to_string()),
            Some("127.0.0.1:9".to_string())
        );
        assert_eq!(addr("http://r:s@proxy.example:3128"), None);
    }
}
