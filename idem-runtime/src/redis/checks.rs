//! The start-up checks: the server's version and eviction settings, on every
//! node of a cluster, and a cluster node given as one server refused.

use redis::Value;

use super::connection::RedisConnection;
use super::{RedisLeaseStore, redis_err};
use crate::model::StoreError;

/// What the start-up check makes of the server's eviction settings.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionVerdict {
    /// Nothing idem keeps can be evicted.
    Safe,
    /// Something may be evicted, or the settings could not be read; why.
    Warn(String),
    /// Any record may be evicted, uncertain ones included; why.
    Refuse(String),
}

/// Judges a server's `maxmemory-policy` and `maxmemory` (bytes, 0 = no limit).
///
/// * `noeviction`: safe.
/// * `allkeys-*`: refused, whatever `maxmemory` is now: any record may go, an
///   in-flight lease (a retry then runs concurrently) or an uncertain outcome
///   (which then never gets reconciled) alike; a later `CONFIG SET maxmemory`
///   would turn it on without a word.
/// * `volatile-*`: a warning: only keys with a TTL may go (finished outcomes
///   and in-flight leases; an uncertain record has none), and a retry of an
///   evicted key runs again with the same downstream key. Without `maxmemory`
///   nothing goes yet, but a later `CONFIG SET maxmemory` turns it on without
///   a word, so that is a warning too.
/// * anything else: a warning.
pub fn eviction_verdict(policy: &str, maxmemory: u64) -> EvictionVerdict {
    let policy = policy.to_ascii_lowercase();
    if policy == "noeviction" {
        EvictionVerdict::Safe
    } else if policy.starts_with("allkeys-") {
        EvictionVerdict::Refuse(format!(
            "maxmemory-policy is {policy}: Redis may evict any of idem's records, uncertain \
             outcomes and live leases included; set it to noeviction (or volatile-*)"
        ))
    } else if policy.starts_with("volatile-") {
        let when = if maxmemory == 0 {
            "once maxmemory is set (it is 0 now)".to_owned()
        } else {
            format!("with maxmemory {maxmemory}")
        };
        EvictionVerdict::Warn(format!(
            "maxmemory-policy is {policy}: {when}, finished outcomes and live leases may be \
             evicted before their time; a retry of such a key executes again, even while its \
             first execution still runs (with the same downstream key, so only a provider \
             honouring it keeps the effect single); noeviction keeps them"
        ))
    } else {
        EvictionVerdict::Warn(format!(
            "maxmemory-policy {policy:?} is not one idem knows; it may evict idem's records"
        ))
    }
}

/// The oldest Redis the store runs on: 6.2, the first with `ZRANGE ...
/// BYSCORE`, which lists uncertain records for the reconciler. (The scripts
/// themselves need 5.0: `redis.call('TIME')` before a write.)
pub const MIN_REDIS_VERSION: (u32, u32) = (6, 2);

/// What the start-up check makes of the server's version.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum VersionVerdict {
    /// [`MIN_REDIS_VERSION`] or newer: the version the server reports.
    Supported(String),
    /// The version could not be read; why (a warning).
    Unknown(String),
    /// Older than [`MIN_REDIS_VERSION`]; why.
    Refuse(String),
}

/// Judges the text of `INFO server` by its `redis_version` line: 6.2 or newer
/// is supported, anything older refused; no such line, or a version that is
/// not `major.minor...`, is unknown (a warning: a server that does not say
/// may still be recent).
pub fn version_verdict(info_server: &str) -> VersionVerdict {
    let Some(version) = info_server
        .lines()
        .find_map(|l| l.trim().strip_prefix("redis_version:"))
        .map(str::trim)
    else {
        return VersionVerdict::Unknown(
            "INFO server names no redis_version: the server's version is unknown; the store \
             needs Redis 6.2 or newer"
                .into(),
        );
    };
    // Each part's leading digits: "7.2.0", "7.4-rc1"...
    let number = |part: Option<&str>| -> Option<u32> {
        let part = part?;
        let digits = part.len() - part.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        part[..digits].parse().ok()
    };
    let mut parts = version.split('.');
    match (number(parts.next()), number(parts.next())) {
        (Some(major), Some(minor)) if (major, minor) >= MIN_REDIS_VERSION => {
            VersionVerdict::Supported(version.to_owned())
        }
        (Some(_), Some(_)) => VersionVerdict::Refuse(format!(
            "Redis {version} is older than 6.2, which the store needs (the reconciler lists \
             uncertain records with ZRANGE ... BYSCORE); upgrade the server"
        )),
        _ => VersionVerdict::Unknown(format!(
            "redis_version {version:?} is not a version idem can read; the store needs Redis \
             6.2 or newer"
        )),
    }
}

/// A node's verdict, as [`worst`] compares them.
trait Verdict {
    /// How bad: 0 fine, 1 a warning, 2 a refusal.
    fn rank(&self) -> u8;
    /// The text that says why, for the verdicts that have one.
    fn why(&mut self) -> Option<&mut String>;
}

impl Verdict for VersionVerdict {
    fn rank(&self) -> u8 {
        match self {
            VersionVerdict::Supported(_) => 0,
            VersionVerdict::Unknown(_) => 1,
            VersionVerdict::Refuse(_) => 2,
        }
    }

    fn why(&mut self) -> Option<&mut String> {
        match self {
            VersionVerdict::Supported(_) => None,
            VersionVerdict::Unknown(w) | VersionVerdict::Refuse(w) => Some(w),
        }
    }
}

impl Verdict for EvictionVerdict {
    fn rank(&self) -> u8 {
        match self {
            EvictionVerdict::Safe => 0,
            EvictionVerdict::Warn(_) => 1,
            EvictionVerdict::Refuse(_) => 2,
        }
    }

    fn why(&mut self) -> Option<&mut String> {
        match self {
            EvictionVerdict::Safe => None,
            EvictionVerdict::Warn(w) | EvictionVerdict::Refuse(w) => Some(w),
        }
    }
}

/// One verdict for a cluster from its nodes' (by address): the worst, its
/// reason prefixed with the node's address.
fn worst<V: Verdict>(mut verdicts: Vec<(String, V)>) -> Option<V> {
    verdicts.sort_by_key(|(_, v)| std::cmp::Reverse(v.rank()));
    let (addr, mut v) = verdicts.into_iter().next()?;
    if let Some(why) = v.why()
        && !addr.is_empty()
    {
        *why = format!("{addr}: {why}");
    }
    Some(v)
}

fn text(v: &Value) -> Option<String> {
    super::text(v)
}

impl RedisLeaseStore {
    /// Reads the server's version (`INFO server`) and judges it
    /// ([`version_verdict`]); on a cluster, every node's (replicas too: a
    /// failover makes one a master), the worst verdict naming its node. A
    /// server that refuses `INFO` gets a warning, not a refusal.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis cannot be reached.
    pub async fn check_version(&self) -> Result<VersionVerdict, StoreError> {
        let info = self
            .conn
            .on_every_node(redis::cmd("INFO").arg("server"))
            .await;
        let nodes = match info {
            Ok(nodes) => nodes,
            Err(e) if e.is_io_error() || e.is_connection_dropped() => return Err(redis_err(e)),
            Err(e) => {
                return Ok(VersionVerdict::Unknown(format!(
                    "INFO server was refused ({e}): the server's version is unknown; the store \
                     needs Redis 6.2 or newer"
                )));
            }
        };
        let verdicts: Vec<(String, VersionVerdict)> = nodes
            .into_iter()
            .map(|(addr, v)| (addr, version_verdict(&text(&v).unwrap_or_default())))
            .collect();
        let versions: std::collections::BTreeSet<String> = verdicts
            .iter()
            .filter_map(|(_, v)| match v {
                VersionVerdict::Supported(s) => Some(s.clone()),
                _ => None,
            })
            .collect();
        let verdict = worst(verdicts);
        Ok(match verdict {
            // Every node supported: their versions, one if they agree.
            Some(VersionVerdict::Supported(_)) => {
                VersionVerdict::Supported(versions.into_iter().collect::<Vec<_>>().join(", "))
            }
            Some(other) => other,
            None => VersionVerdict::Unknown("no node answered INFO server".into()),
        })
    }

    /// Reads the server's eviction settings and judges them
    /// ([`eviction_verdict`]); on a cluster, every node's (replicas too: a
    /// failover makes one a master), the worst verdict naming its node. A
    /// server that refuses `CONFIG GET` gets a warning, not a refusal.
    ///
    /// # Errors
    ///
    /// [`StoreError::Redis`] when Redis cannot be reached.
    pub async fn check_eviction(&self) -> Result<EvictionVerdict, StoreError> {
        let read = async {
            let policy = self
                .conn
                .on_every_node(redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy"))
                .await?;
            let max = self
                .conn
                .on_every_node(redis::cmd("CONFIG").arg("GET").arg("maxmemory"))
                .await?;
            Ok::<_, redis::RedisError>((policy, max))
        };
        let (policy, max) = match read.await {
            Ok(read) => read,
            Err(e) if e.is_io_error() || e.is_connection_dropped() => return Err(redis_err(e)),
            Err(e) => {
                return Ok(EvictionVerdict::Warn(format!(
                    "CONFIG GET was refused ({e}): the eviction policy is unknown; make sure it is \
                     noeviction"
                )));
            }
        };
        // `CONFIG GET x` answers [x, value] (a map in RESP3).
        let value = |v: &Value| -> Option<String> {
            match v {
                Value::Array(items) => items.get(1).and_then(text),
                Value::Map(pairs) => pairs.first().and_then(|(_, v)| text(v)),
                _ => None,
            }
        };
        let verdicts = policy
            .iter()
            .map(|(addr, p)| {
                let max = max
                    .iter()
                    .find(|(a, _)| a == addr)
                    .and_then(|(_, m)| value(m));
                let verdict = match (value(p), max) {
                    (Some(policy), Some(max)) => {
                        eviction_verdict(&policy, max.parse::<u64>().unwrap_or(u64::MAX))
                    }
                    _ => EvictionVerdict::Warn(
                        "CONFIG GET answered nothing: the eviction policy is unknown; make sure \
                         it is noeviction"
                            .into(),
                    ),
                };
                (addr.clone(), verdict)
            })
            .collect();
        Ok(worst(verdicts)
            .unwrap_or_else(|| EvictionVerdict::Warn("no node answered CONFIG GET".into())))
    }

    /// Refuses a node of a Redis Cluster reached as one server: most keys would
    /// be answered `MOVED`. A server that refuses `INFO cluster` passes.
    pub(super) async fn refuse_a_cluster_node(conn: &RedisConnection) -> Result<(), StoreError> {
        let RedisConnection::Server(c) = conn else {
            return Ok(());
        };
        let info: Result<String, _> = redis::cmd("INFO")
            .arg("cluster")
            .query_async(&mut c.clone())
            .await;
        match info {
            Ok(info) if info.lines().any(|l| l.trim() == "cluster_enabled:1") => {
                Err(super::refused(
                    "this server is a node of a Redis Cluster, reached as one server: most keys \
                     would be answered MOVED; connect with RedisLeaseStore::connect_cluster (or \
                     with_cluster_client) and every node's address"
                        .into(),
                ))
            }
            Ok(_) => Ok(()),
            Err(e) if e.is_io_error() || e.is_connection_dropped() => Err(redis_err(e)),
            Err(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_older_than_6_2_are_refused() {
        let info = |v: &str| {
            format!(
                "# Server\r\nredis_version:{v}\r\nredis_git_sha1:00000000\r\n\
                 redis_mode:standalone\r\n"
            )
        };
        for old in ["6.0.16", "6.1.99", "5.0.14", "2.8.24"] {
            match version_verdict(&info(old)) {
                VersionVerdict::Refuse(why) => {
                    assert!(why.contains(old) && why.contains("6.2"), "{why}")
                }
                other => panic!("{old}: {other:?}"),
            }
        }
        for new in [
            "6.2.0",
            "6.2.14",
            "7.0.15",
            "7.4-rc1",
            "10.0.0",
            "255.255.255",
        ] {
            assert_eq!(
                version_verdict(&info(new)),
                VersionVerdict::Supported(new.to_owned())
            );
        }
        // Lines ending in \n alone, and a server that says more after it.
        assert_eq!(
            version_verdict("# Server\nredis_version:6.2.6\nvalkey_version:8.0.1\n"),
            VersionVerdict::Supported("6.2.6".into())
        );
        for unreadable in [
            "# Server\r\nredis_mode:standalone\r\n",
            &info("unstable"),
            &info("7"),
        ] {
            assert!(
                matches!(version_verdict(unreadable), VersionVerdict::Unknown(_)),
                "{unreadable:?}"
            );
        }
    }

    #[test]
    fn eviction_policies_are_judged() {
        assert_eq!(eviction_verdict("noeviction", 0), EvictionVerdict::Safe);
        assert!(matches!(
            eviction_verdict("allkeys-lru", 0),
            EvictionVerdict::Refuse(_)
        ));
        assert!(matches!(
            eviction_verdict("allkeys-random", 1 << 30),
            EvictionVerdict::Refuse(_)
        ));
        let EvictionVerdict::Warn(unset) = eviction_verdict("volatile-ttl", 0) else {
            panic!("volatile-* without maxmemory is a warning");
        };
        assert!(unset.contains("once maxmemory is set"), "{unset}");
        assert!(matches!(
            eviction_verdict("volatile-lru", 1 << 30),
            EvictionVerdict::Warn(_)
        ));
        assert!(matches!(
            eviction_verdict("something-new", 0),
            EvictionVerdict::Warn(_)
        ));
    }

    #[test]
    fn a_cluster_is_judged_by_its_worst_node_which_is_named() {
        let nodes = vec![
            (
                "127.0.0.1:7000".to_owned(),
                eviction_verdict("noeviction", 0),
            ),
            (
                "127.0.0.1:7001".to_owned(),
                eviction_verdict("allkeys-lru", 0),
            ),
            (
                "127.0.0.1:7002".to_owned(),
                eviction_verdict("volatile-lru", 1),
            ),
        ];
        let v = worst(nodes);
        match v {
            Some(EvictionVerdict::Refuse(why)) => {
                assert!(
                    why.starts_with("127.0.0.1:7001: maxmemory-policy is allkeys-lru"),
                    "{why}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
