//! A ferrosan daemon's Prometheus endpoint, read for the target's CPU time per I/O: the
//! cost that decides how many hosts one array serves, which the client cannot see.

use std::time::Duration;

/// The largest metrics page read (a daemon with thousands of sessions stays well below).
const BODY_LIMIT: u64 = 32 << 20;
const TIMEOUT: Duration = Duration::from_secs(5);

pub struct TargetMetrics {
    pub url: String,
    agent: ureq::Agent,
}

impl TargetMetrics {
    /// `http://HOST:PORT/metrics`, or `HOST:PORT` for it. Reads the page once: an endpoint
    /// that does not answer, or is not a ferrosan daemon's, is refused before any I/O.
    pub fn open(spec: &str) -> Result<TargetMetrics, String> {
        let url = if spec.contains("://") {
            spec.to_string()
        } else {
            format!("http://{spec}/metrics")
        };
        if !url.starts_with("http://") {
            return Err(format!(
                "--target-metrics {spec}: an http:// URL or HOST:PORT"
            ));
        }
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(TIMEOUT))
            .build()
            .into();
        let m = TargetMetrics { url, agent };
        let page = m.page()?;
        if cpu_seconds(&page).is_none() {
            return Err(format!(
                "--target-metrics {}: no process_cpu_seconds_total in the page (not a ferrosan daemon's metrics?)",
                m.url
            ));
        }
        Ok(m)
    }

    fn page(&self) -> Result<String, String> {
        self.agent
            .get(&self.url)
            .call()
            .and_then(|mut r| {
                r.body_mut()
                    .with_config()
                    .limit(BODY_LIMIT)
                    .read_to_string()
            })
            .map_err(|e| format!("--target-metrics {}: {e}", self.url))
    }

    /// The daemon's CPU time (user + system) so far; `None` when it cannot be read now.
    pub fn cpu(&self) -> Option<Duration> {
        let s = cpu_seconds(&self.page().ok()?)?;
        Duration::try_from_secs_f64(s).ok()
    }

    /// Whether the daemon serves `node` (a target IQN or subsystem NQN): its metrics carry
    /// the name as a label value.
    pub fn serves(&self, node: &str) -> bool {
        self.page().is_ok_and(|p| names(&p, node))
    }
}

/// `process_cpu_seconds_total` of a Prometheus or OpenMetrics text page.
pub fn cpu_seconds(page: &str) -> Option<f64> {
    page.lines().find_map(|line| {
        let value = line.strip_prefix("process_cpu_seconds_total")?;
        let value = value.strip_prefix(' ')?.split_ascii_whitespace().next()?;
        value
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v >= 0.0)
    })
}

/// Whether a sample of `page` has `node` as a label value.
fn names(page: &str, node: &str) -> bool {
    let quoted = format!("=\"{node}\"");
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .any(|l| l.contains(&quoted))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP process_cpu_seconds User and system CPU time spent, in seconds.\n\
        # TYPE process_cpu_seconds counter\n\
        process_cpu_seconds_total 12.5\n\
        process_cpu_seconds_total_x 99\n\
        ferrosan_sessions{target=\"iqn.2026-11.org.x:t\"} 1\n\
        # HELP a \"iqn.2026-11.org.x:other\"\n";

    #[test]
    fn the_cpu_counter_and_the_served_names_are_read_from_the_page() {
        assert_eq!(cpu_seconds(PAGE), Some(12.5));
        assert_eq!(cpu_seconds("process_cpu_seconds_total NaN\n"), None);
        assert_eq!(cpu_seconds("up 1\n"), None);
        assert!(names(PAGE, "iqn.2026-11.org.x:t"));
        // A prefix, or a name only in a comment, is not a match.
        assert!(!names(PAGE, "iqn.2026-11.org.x"));
        assert!(!names(PAGE, "iqn.2026-11.org.x:other"));
    }

    #[test]
    fn an_endpoint_that_is_not_there_or_not_ferrosans_is_refused() {
        let e = TargetMetrics::open("https://127.0.0.1:1/metrics")
            .err()
            .unwrap();
        assert!(e.contains("http://"), "{e}");
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = free.local_addr().unwrap();
        drop(free);
        assert!(TargetMetrics::open(&addr.to_string()).is_err());
        // A web server that is not a ferrosan daemon.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).unwrap();
            s.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nup 1\n")
                .unwrap();
        });
        let e = TargetMetrics::open(&format!("http://{addr}/metrics"))
            .err()
            .unwrap();
        assert!(e.contains("process_cpu_seconds_total"), "{e}");
        server.join().unwrap();
    }
}
