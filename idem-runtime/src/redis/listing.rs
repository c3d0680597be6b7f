//! The reconciler's listing: one operation's uncertain records, read from
//! every shard's index and merged in (score, member) order, so a page is the
//! same whatever shard its records are in.

use std::collections::VecDeque;

use redis::Value;

use super::layout::{escape, shards};
use super::{RedisLeaseStore, corrupt, redis_err, text};
use crate::model::StoreError;

/// An uncertain record as the reconciler lists it on Redis.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct RedisUncertain {
    pub(super) member: String,
    pub(super) score: f64,
    pub(super) tenant: String,
    pub(super) digest: String,
    pub(super) downstream_key: String,
    /// The record's `gen`: its executions while it is kept (it starts again at
    /// 1 once the record is gone, as on SQL once a row is swept).
    pub(super) generation: i64,
    pub(super) token: String,
    /// Why this uncertain record cannot be reconciled (a field gone), if so:
    /// listed all the same, so the round counts it as an error as it does a SQL
    /// row without its downstream key, rather than skip it in silence.
    pub(super) broken: Option<String>,
}

impl RedisUncertain {
    fn broken(member: String, score: f64, digest: &str, why: String) -> RedisUncertain {
        RedisUncertain {
            member,
            score,
            tenant: String::new(),
            digest: digest.to_owned(),
            downstream_key: String::new(),
            generation: 0,
            token: String::new(),
            broken: Some(why),
        }
    }
}

/// An entry of an uncertain index, as the listing reads it.
enum Entry {
    /// For the reconciler: an uncertain record, or one it cannot ask about
    /// (`broken`), which the round counts as an error.
    Listed(RedisUncertain),
    /// Its record is no longer uncertain, or gone: the entry is to be pruned.
    Stale { name: String, member: String },
}

/// One shard's index as the listing reads it: a chunk at a time, by offset
/// from the page's first score.
struct Shard {
    shard: char,
    index: String,
    offset: usize,
    read: VecDeque<(String, f64)>,
    ended: bool,
}

/// An index entry picked for the page, with its shard.
struct Candidate {
    shard: usize,
    member: String,
    score: f64,
}

impl RedisLeaseStore {
    /// Up to `limit` uncertain records of `operation` after `after`, in (score,
    /// member) order over every shard; fewer only at the indexes' end.
    ///
    /// A page is `limit` entries for the reconciler, or fewer only at the end:
    /// the reconciler takes a short page for the newest and starts over from
    /// the oldest. So the stale entries dropped here never shorten a page: the
    /// listing reads on past them. Each shard's index is read a chunk at a
    /// time, by offset from `after`'s score (entries at that score up to
    /// `after` itself were on an earlier page); the shards' heads are merged,
    /// and the picked entries' records read with one pipeline per shard (on one
    /// server, one pipeline in all). Stale entries are pruned after the scan,
    /// so the offsets hold while it runs.
    pub(super) async fn list_uncertain(
        &self,
        operation: &str,
        after: Option<&RedisUncertain>,
        limit: usize,
    ) -> Result<Vec<RedisUncertain>, StoreError> {
        let min = after.map_or("-inf".to_owned(), |a| a.score.to_string());
        let mut shards: Vec<Shard> = shards()
            .map(|shard| Shard {
                shard,
                index: self.layout.index(operation, shard),
                offset: 0,
                read: VecDeque::new(),
                ended: false,
            })
            .collect();
        let mut rows = Vec::with_capacity(limit);
        let mut stale: Vec<(usize, String, String)> = Vec::new();
        loop {
            let refill: Vec<usize> = (0..shards.len())
                .filter(|&i| shards[i].read.is_empty() && !shards[i].ended)
                .collect();
            if !refill.is_empty() {
                self.read_chunks(&mut shards, &refill, (&min, after, limit))
                    .await?;
            }
            // The next entries in order, as long as every shard that may hold
            // an earlier one has read it.
            let mut picked = Vec::new();
            while rows.len() + picked.len() < limit
                && shards.iter().all(|s| s.ended || !s.read.is_empty())
            {
                let Some(i) = (0..shards.len())
                    .filter(|&i| !shards[i].read.is_empty())
                    .min_by(|&a, &b| {
                        let (ma, sa) = &shards[a].read[0];
                        let (mb, sb) = &shards[b].read[0];
                        sa.total_cmp(sb).then_with(|| ma.cmp(mb))
                    })
                else {
                    break;
                };
                let (member, score) = shards[i].read.pop_front().expect("not empty");
                picked.push(Candidate {
                    shard: i,
                    member,
                    score,
                });
            }
            for (shard, entry) in self.read_entries(operation, &shards, picked).await? {
                match entry {
                    Entry::Listed(row) => rows.push(row),
                    Entry::Stale { name, member } => stale.push((shard, name, member)),
                }
            }
            let done = shards.iter().all(|s| s.ended && s.read.is_empty());
            if rows.len() >= limit || done {
                break;
            }
        }
        self.prune(&shards, stale).await;
        Ok(rows)
    }

    /// Reads the next chunk of each of the `refill` shards.
    async fn read_chunks(
        &self,
        shards: &mut [Shard],
        refill: &[usize],
        (min, after, limit): (&str, Option<&RedisUncertain>, usize),
    ) -> Result<(), StoreError> {
        let mut groups = Vec::with_capacity(refill.len());
        for &i in refill {
            let mut p = redis::pipe();
            p.cmd("ZRANGE")
                .arg(&shards[i].index)
                .arg(min)
                .arg("+inf")
                .arg("BYSCORE")
                .arg("LIMIT")
                .arg(shards[i].offset)
                .arg(limit)
                .arg("WITHSCORES");
            groups.push(p);
        }
        let mut replies = self
            .conn
            .run_groups(groups)
            .await
            .map_err(redis_err)?
            .into_iter();
        for &i in refill {
            let reply = replies
                .next()
                .and_then(|r| r.into_iter().next())
                .ok_or_else(|| corrupt("the uncertain index: a reply short"))?;
            let chunk: Vec<(String, f64)> =
                redis::from_redis_value(reply.extract_error().map_err(redis_err)?)
                    .map_err(|e| redis_err(e.into()))?;
            let s = &mut shards[i];
            s.ended = chunk.len() < limit;
            s.offset += chunk.len();
            s.read
                .extend(chunk.into_iter().filter(|(m, score)| match after {
                    Some(a) => *score > a.score || (*score == a.score && *m > a.member),
                    None => true,
                }));
        }
        Ok(())
    }

    /// Reads the records of the picked entries (one pipeline per shard, or one
    /// in all on one server) and tells, entry by entry in the order picked,
    /// which are listed and which stale (with their shard).
    async fn read_entries(
        &self,
        operation: &str,
        shards: &[Shard],
        picked: Vec<Candidate>,
    ) -> Result<Vec<(usize, Entry)>, StoreError> {
        if picked.is_empty() {
            return Ok(Vec::new());
        }
        // An entry names its record by `tenant:digest`; one without the `:`
        // names no record idem writes. Its record is in the index's own shard.
        let names: Vec<Option<String>> = picked
            .iter()
            .map(|c| {
                c.member.contains(':').then(|| {
                    self.layout
                        .record_in(operation, shards[c.shard].shard, &c.member)
                })
            })
            .collect();
        // One group per shard that has a record to read, in shard order.
        let mut group_of = vec![usize::MAX; shards.len()];
        let mut groups: Vec<redis::Pipeline> = Vec::new();
        for (c, name) in picked.iter().zip(&names) {
            let Some(name) = name else { continue };
            if group_of[c.shard] == usize::MAX {
                group_of[c.shard] = groups.len();
                groups.push(redis::pipe());
            }
            groups[group_of[c.shard]]
                .cmd("HMGET")
                .arg(name)
                .arg(&["state", "gen", "token", "tenant", "dkey"]);
        }
        let mut replies: Vec<std::vec::IntoIter<Value>> = self
            .conn
            .run_groups(groups)
            .await
            .map_err(redis_err)?
            .into_iter()
            .map(Vec::into_iter)
            .collect();
        let mut entries = Vec::with_capacity(picked.len());
        for (c, name) in picked.into_iter().zip(names) {
            let index = &shards[c.shard].index;
            let (Some(name), Some((tenant_esc, digest))) = (name, c.member.rsplit_once(':')) else {
                tracing::warn!(index = %index, "idem: redis: a foreign entry in the uncertain index; counted as an error and left as it is");
                entries.push((
                    c.shard,
                    Entry::Listed(RedisUncertain::broken(
                        c.member,
                        c.score,
                        "",
                        "an uncertain index entry that names no record (no `tenant:` part); left \
                         for a person to look at"
                            .into(),
                    )),
                ));
                continue;
            };
            let (tenant_esc, digest) = (tenant_esc.to_owned(), digest.to_owned());
            let reply = replies
                .get_mut(group_of[c.shard])
                .and_then(Iterator::next)
                .ok_or_else(|| corrupt("the uncertain index's records: a reply short"))?;
            // A foreign value at a record's name (not a hash) is one broken
            // entry, not an error of the whole page, which would starve the
            // others.
            let fields: Vec<Option<String>> = match reply.extract_error() {
                Ok(Value::Array(r)) => r.iter().map(text).collect(),
                Ok(_) => return Err(corrupt("the uncertain index's records: HMGET")),
                Err(e) => {
                    tracing::warn!(index = %index, error = %e, "idem: redis: an uncertain index entry whose record cannot be read");
                    vec![Some("uncertain".to_owned())]
                }
            };
            let member = c.member;
            entries.push((
                c.shard,
                match &fields[..] {
                    // A generation that is not a number is a broken record
                    // (below), not an error of the whole page.
                    [Some(state), Some(g), Some(token), Some(tenant), Some(dkey)]
                        if state == "uncertain"
                            && escape(tenant) == tenant_esc
                            && g.parse::<i64>().is_ok() =>
                    {
                        Entry::Listed(RedisUncertain {
                            member,
                            score: c.score,
                            tenant: tenant.clone(),
                            digest,
                            downstream_key: dkey.clone(),
                            generation: g.parse().unwrap_or_default(),
                            token: token.clone(),
                            broken: None,
                        })
                    }
                    // Listed, so that describing it fails and the round reports
                    // (and counts) an error, as on SQL; it is never resolved.
                    [Some(state), ..] if state == "uncertain" => Entry::Listed(RedisUncertain::broken(
                        member,
                        c.score,
                        &digest,
                        "an uncertain record without its fields (or with a malformed one); left \
                         for a person to look at"
                            .into(),
                    )),
                    // Not uncertain any more (resolved or re-executed
                    // meanwhile), or gone (a restart without persistence, a
                    // hand deletion): the entry is pruned.
                    _ => Entry::Stale { name, member },
                },
            ));
        }
        Ok(entries)
    }

    /// Removes stale index entries, with scripts that each check the record
    /// again, so an execution that became uncertain since keeps its entry: one
    /// pipeline per shard (one in all on one server). A failure is logged and
    /// leaves the entries for a later round.
    async fn prune(&self, shards: &[Shard], stale: Vec<(usize, String, String)>) {
        if stale.is_empty() {
            return;
        }
        let mut group_of = vec![usize::MAX; shards.len()];
        let mut groups: Vec<redis::Pipeline> = Vec::new();
        for (shard, name, member) in &stale {
            if group_of[*shard] == usize::MAX {
                group_of[*shard] = groups.len();
                let mut p = redis::pipe();
                // EVALSHA in a pipeline does not load a script the server
                // lacks; on a cluster this loads it on the shard's master.
                p.load_script(&self.scripts.prune);
                groups.push(p);
            }
            let mut inv = self.scripts.prune.key(name);
            inv.key(&shards[*shard].index).arg(member);
            groups[group_of[*shard]].invoke_script(&inv);
        }
        let failed = match self.conn.run_groups(groups).await {
            Ok(replies) => replies
                .into_iter()
                .flatten()
                .find_map(|v| v.extract_error().err()),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            tracing::warn!(error = %e, "idem: redis: entries of the uncertain index without their records; left as they are");
        }
    }
}
