//! How long bytes of a WRITE may still land in D after P's agent reported it done or abandoned
//! it: the endpoint's *delivery bound* (`kvpush_core::endpoint::EndpointConfig::delivery_bound`),
//! part of the write horizon P advertises, read from the UCX transports this process's
//! environment selects.
//!
//! - Only a loopback device (`UCX_NET_DEVICES=lo`): nothing travels beyond this host, so nothing
//!   lands late ([`Carrier::Loopback`], 0).
//! - UCX may carry the data over TCP ([`tls_allows_tcp`]): a WRITE "completes" once the kernel
//!   has the bytes, and a cut link that comes back delivers them until TCP gives up
//!   retransmitting ([`tcp_retransmission_span`]: about 15 minutes with Linux's defaults).
//! - Otherwise RDMA's default retry budget ([`RDMA_DELIVERY_BOUND`]).
//!
//! [`DELIVERY_BOUND_ENV`] overrides the lot, for hosts that know better (e.g. a lowered
//! `UCX_RC_TIMEOUT`).

use std::time::Duration;

/// Environment variable that overrides [`delivery_bound`]: seconds, a number >= 0.
pub const DELIVERY_BOUND_ENV: &str = "KVPUSH_DELIVERY_BOUND";

/// The delivery bound when UCX cannot use TCP: RDMA's retry budget with UCX's defaults
/// (`UCX_RC_TIMEOUT` 1 s, 8 attempts); a queue pair that exhausts it is in error and delivers
/// nothing more.
pub const RDMA_DELIVERY_BOUND: Duration = Duration::from_secs(8);

/// TCP's shortest retransmission timeout (`TCP_RTO_MIN`) and its longest (`TCP_RTO_MAX`).
const TCP_RTO_MIN: Duration = Duration::from_millis(200);
const TCP_RTO_MAX: Duration = Duration::from_secs(120);

/// How UCX may carry a WRITE's bytes, as `UCX_NET_DEVICES` and `UCX_TLS` select.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Carrier {
    /// Only the loopback device: the bytes never leave this host.
    Loopback,
    /// TCP may carry them (alone or among other transports).
    Tcp,
    /// Transports without TCP: RDMA (or shared memory, which delivers at once).
    NoTcp,
}

impl Carrier {
    /// The carrier for the given values of `UCX_NET_DEVICES` and `UCX_TLS` (empty: unset).
    pub fn of(net_devices: &str, tls: &str) -> Self {
        if !net_devices.is_empty() && net_devices.split(',').all(|device| device.trim() == "lo") {
            Self::Loopback
        } else if tls_allows_tcp(tls) {
            Self::Tcp
        } else {
            Self::NoTcp
        }
    }

    /// The carrier this process's UCX environment selects.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).unwrap_or_default();
        Self::of(&var("UCX_NET_DEVICES"), &var("UCX_TLS"))
    }

    /// How long bytes this carrier accepted may still land: 0, this host's
    /// [`tcp_retransmission_span`], or [`RDMA_DELIVERY_BOUND`].
    pub fn delivery_bound(self) -> Duration {
        match self {
            Self::Loopback => Duration::ZERO,
            Self::Tcp => {
                tcp_retransmission_span(sysctl("tcp_retries2"), sysctl("tcp_orphan_retries"))
            }
            Self::NoTcp => RDMA_DELIVERY_BOUND,
        }
    }
}

/// Whether `UCX_TLS` = `tls` lets UCX use TCP: unset (UCX picks among all its transports), an
/// exclusion list (`^...`), `all`, or a list naming `tcp`. A conservative reading: an exclusion
/// list that excludes TCP still counts, since a longer bound is safe and a shorter one is not.
pub fn tls_allows_tcp(tls: &str) -> bool {
    let tls = tls.to_lowercase();
    tls.is_empty() || tls.starts_with('^') || tls.contains("tcp") || tls.contains("all")
}

/// How long the kernel keeps retransmitting a TCP connection's unacknowledged bytes before it
/// aborts the connection: the doubling retransmission timeouts from TCP's 200 ms minimum
/// (capped at 120 s), for the larger of `tcp_retries2` (unknown: Linux's default, 15) and
/// `tcp_orphan_retries` (for connections closed with data queued; 0 or unknown means 8).
pub fn tcp_retransmission_span(retries2: Option<u32>, orphan_retries: Option<u32>) -> Duration {
    let retries = retries2.unwrap_or(15);
    let orphan = match orphan_retries {
        None | Some(0) => 8,
        Some(n) => n,
    };
    (0..=retries.max(orphan).min(64))
        .map(|i| TCP_RTO_MIN.saturating_mul(1 << i.min(20)).min(TCP_RTO_MAX))
        .sum()
}

/// `net.ipv4.<name>` in this process's network namespace.
fn sysctl(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}"))
        .ok()
        .and_then(|text| text.trim().parse().ok())
}

/// The delivery bound of a NIXL agent in this process: [`DELIVERY_BOUND_ENV`] if set, else
/// [`Carrier::from_env`]'s. An endpoint on a NIXL transport advertises it in its write horizon.
///
/// # Errors
///
/// [`DELIVERY_BOUND_ENV`] is set but is not a number of seconds >= 0.
pub fn delivery_bound() -> Result<Duration, BadDeliveryBound> {
    match std::env::var(DELIVERY_BOUND_ENV) {
        Ok(given) => parse_seconds(&given),
        Err(_) => Ok(Carrier::from_env().delivery_bound()),
    }
}

/// Why [`DELIVERY_BOUND_ENV`]'s value is not a delivery bound.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BadDeliveryBound {
    /// Not a number.
    #[error("{DELIVERY_BOUND_ENV} must be seconds, not {given:?}")]
    NotSeconds {
        /// The variable's value.
        given: String,
    },
    /// A number that is no duration: negative, infinite or NaN.
    #[error("{DELIVERY_BOUND_ENV} must be a finite number of seconds >= 0, not {value}")]
    OutOfRange {
        /// The number given.
        value: f64,
    },
}

/// [`DELIVERY_BOUND_ENV`]'s value as a duration.
fn parse_seconds(given: &str) -> Result<Duration, BadDeliveryBound> {
    let value: f64 = given
        .trim()
        .parse()
        .map_err(|_| BadDeliveryBound::NotSeconds { given: given.to_owned() })?;
    Duration::try_from_secs_f64(value).map_err(|_| BadDeliveryBound::OutOfRange { value })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_counts_unless_ucx_tls_lists_transports_without_it() {
        for tls in ["", "tcp", "TCP", "rc,tcp", "sm,cma,tcp", "all", "^rc", "^tcp"] {
            assert!(tls_allows_tcp(tls), "{tls:?}");
        }
        for tls in ["rc", "rc_x,ud_x", "sm,cma", "cuda_copy,rc"] {
            assert!(!tls_allows_tcp(tls), "{tls:?}");
        }
    }

    #[test]
    fn only_loopback_devices_make_the_carrier_loopback() {
        assert_eq!(Carrier::of("lo", ""), Carrier::Loopback);
        assert_eq!(Carrier::of("lo, lo", "rc"), Carrier::Loopback);
        assert_eq!(Carrier::of("", ""), Carrier::Tcp, "unset: every device, TCP among them");
        assert_eq!(Carrier::of("lo,eth0", "tcp"), Carrier::Tcp);
        assert_eq!(Carrier::of("mlx5_0:1", "rc,ud"), Carrier::NoTcp);
        assert_eq!(Carrier::Loopback.delivery_bound(), Duration::ZERO);
        assert_eq!(Carrier::NoTcp.delivery_bound(), RDMA_DELIVERY_BOUND);
    }

    #[test]
    fn tcp_retransmission_span_doubles_from_200_ms_up_to_120_s() {
        // Retries 0..=15: 200 ms doubling to 102.4 s (10 terms: 204.6 s), then 6 x 120 s.
        let linux_default = Duration::from_millis(200 * 1_023) + Duration::from_secs(6 * 120);
        assert_eq!(tcp_retransmission_span(Some(15), Some(0)), linux_default);
        assert_eq!(tcp_retransmission_span(None, None), linux_default);
        // tcp_retries2 = 5 (a common hardening): 200 ms x (2^6 - 1); the orphan default (8) wins.
        assert_eq!(tcp_retransmission_span(Some(5), Some(3)), Duration::from_millis(200 * 63));
        assert_eq!(tcp_retransmission_span(Some(5), None), Duration::from_millis(200 * 511));
        assert_eq!(tcp_retransmission_span(Some(2), Some(2)), Duration::from_millis(200 * 7));
    }

    #[test]
    fn an_explicit_bound_must_be_seconds() {
        assert_eq!(parse_seconds(" 2.5 "), Ok(Duration::from_millis(2_500)));
        assert_eq!(parse_seconds("0"), Ok(Duration::ZERO));
        let err = parse_seconds("soon").unwrap_err().to_string();
        assert!(err.contains(DELIVERY_BOUND_ENV) && err.contains("\"soon\""), "{err}");
        for bad in ["-1", "inf", "NaN"] {
            let err = parse_seconds(bad).unwrap_err().to_string();
            assert!(err.contains("finite number of seconds >= 0"), "{bad}: {err}");
        }
    }
}
