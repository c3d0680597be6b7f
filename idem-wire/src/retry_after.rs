//! `Retry-After` (RFC 9110, section 10.2.3): written by the server as whole
//! seconds, read by a client in either of its two forms.

use std::time::{Duration, SystemTime};

/// The `Retry-After` seconds the server sends for a wait: whole seconds,
/// rounded up (a client that waits what it is told never comes back early),
/// and at least 1 (`0` would invite a retry at once).
///
/// ```
/// use std::time::Duration;
/// use idem_wire::retry_after_seconds;
///
/// assert_eq!(retry_after_seconds(Duration::from_secs(3)), 3);
/// assert_eq!(retry_after_seconds(Duration::from_millis(1500)), 2);
/// assert_eq!(retry_after_seconds(Duration::ZERO), 1);
/// ```
pub fn retry_after_seconds(wait: Duration) -> u64 {
    wait.as_secs()
        .saturating_add(u64::from(wait.subsec_nanos() > 0))
        .max(1)
}

/// A `Retry-After` value as a wait from `now`: delta-seconds, or an HTTP date
/// (a date in the past is no wait). Surrounding white space is ignored; a value
/// that is neither is `None`, to be treated as absent.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use idem_wire::parse_retry_after;
///
/// let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
/// assert_eq!(parse_retry_after("120", now), Some(Duration::from_secs(120)));
/// assert_eq!(
///     parse_retry_after("Wed, 21 Oct 2015 07:30:00 GMT", now),
///     Some(Duration::from_secs(120))
/// );
/// assert_eq!(parse_retry_after("soon", now), None);
/// // Past what a `u64` holds: the longest wait.
/// assert_eq!(
///     parse_retry_after("99999999999999999999999", now),
///     Some(Duration::from_secs(u64::MAX))
/// );
/// ```
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    // Delta-seconds have no upper bound (RFC 9110): more than a `u64` holds is
    // the longest wait, not an absent one (which would be retried at once).
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_rounds_up_to_whole_seconds_and_says_at_least_1() {
        assert_eq!(retry_after_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(retry_after_seconds(Duration::from_millis(10)), 1);
        assert_eq!(retry_after_seconds(Duration::from_nanos(1)), 1);
        assert_eq!(retry_after_seconds(Duration::from_secs(3)), 3);
        assert_eq!(retry_after_seconds(Duration::from_nanos(3_000_000_001)), 4);
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
        assert_eq!(retry_after_seconds(Duration::MAX), u64::MAX);
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("0", now), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(90))
        );
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(parse_retry_after(&earlier, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
        assert_eq!(parse_retry_after("", now), None);
    }

    #[test]
    fn what_the_server_writes_the_client_reads_back() {
        let now = SystemTime::now();
        for ms in [0, 1, 999, 1000, 1001, 30_000] {
            let wait = Duration::from_millis(ms);
            let secs = retry_after_seconds(wait);
            let read = parse_retry_after(&secs.to_string(), now).unwrap();
            assert!(read >= wait && read >= Duration::from_secs(1), "{ms} ms");
        }
    }
}
