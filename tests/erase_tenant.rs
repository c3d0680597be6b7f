//! Erasing a tenant (`idem_runtime::admin::erase_tenant`) against real
//! databases: every row of the tenant that no execution in flight needs goes,
//! in batches, in every operation; other tenants' rows stay; a leased row (its
//! lease live or lapsed) and an uncertain row are left and counted until they finish or the caller
//! asks for them too; a row a running transaction holds is left, not waited
//! on. Written once, generic over [`EraseDb`] (the SQL that differs), and
//! stamped per database: `postgres::<name>`, `sqlite::<name>`, `mysql::<name>`.

#[macro_use]
mod common;

use std::time::Duration;

use bytes::Bytes;
use idem_runtime::admin::{self, InFlightRows, KeyAddress, TenantErasure};
use idem_runtime::{
    Backend, Claim, ClaimRequest, FingerprintBuilder, IdempotencyKey, LeaseRequest, LeasedClaim,
    StoreError, StoredResponse, claim, claim_leased,
};
use sqlx::Pool;

/// What the suite needs of a database beyond idem's API.
trait EraseDb: Sized {
    type Db: Backend;

    /// Moves the lease of every row of operation `lapsed` into the past.
    const LAPSE_LEASES: &str;

    /// A fresh database of its own, with idem's migrations applied.
    async fn create() -> Self;
    fn pool(&self) -> &Pool<Self::Db>;
    /// The single integer a query returns.
    async fn count(&self, sql: &str) -> i64;
    async fn exec(&self, sql: &str);
    /// Locks the row of `acme`'s `create-order` key `raw` in `tx` until it ends
    /// (`FOR UPDATE` by primary key; not SQLite's).
    async fn lock_key(&self, tx: &mut sqlx::Transaction<'static, Self::Db>, raw: &str);
}

macro_rules! erase_db {
    ($ty:ty, $db:ty, $lapse:expr) => {
        impl EraseDb for $ty {
            type Db = $db;
            const LAPSE_LEASES: &str = $lapse;

            async fn create() -> Self {
                <$ty>::new().await
            }
            fn pool(&self) -> &Pool<$db> {
                &self.pool
            }
            async fn count(&self, sql: &str) -> i64 {
                <$ty>::count(self, sql).await
            }
            async fn exec(&self, sql: &str) {
                <$ty>::exec(self, sql).await
            }
            async fn lock_key(&self, tx: &mut sqlx::Transaction<'static, $db>, raw: &str) {
                let sql = format!(
                    "SELECT 1 FROM idempotency_requests \
                      WHERE tenant_id = 'acme' AND operation = 'create-order' \
                        AND key_digest = {} FOR UPDATE",
                    self.key(raw)
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(&mut **tx)
                    .await
                    .unwrap();
            }
        }
    };
}

erase_db!(
    common::TestDb,
    sqlx::Postgres,
    "UPDATE idempotency_requests SET lease_expires_at = now() - interval '1 second' \
      WHERE operation = 'lapsed'"
);
erase_db!(
    common::SqliteDb,
    sqlx::Sqlite,
    "UPDATE idempotency_requests SET lease_expires_at = lease_expires_at - 3600000 \
      WHERE operation = 'lapsed'"
);
erase_db!(
    common::MySqlDb,
    sqlx::MySql,
    "UPDATE idempotency_requests SET lease_expires_at = lease_expires_at - 3600000 \
      WHERE operation = 'lapsed'"
);

fn request<'a>(tenant: &'a str, operation: &'a str, key: &'a IdempotencyKey) -> ClaimRequest<'a> {
    ClaimRequest {
        tenant,
        operation,
        key,
        fingerprint: FingerprintBuilder::new(tenant, operation, "POST", "/x").finish(),
        retention: Duration::from_secs(3600),
        in_flight_wait: Duration::from_secs(5),
    }
}

fn answer() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Bytes::from_static(b"{\"card\":\"4242\"}"),
    }
}

/// A finished row of `key`, claimed and completed in a transaction of its own.
async fn finished<T: EraseDb>(db: &T, tenant: &str, operation: &str, key: &str) {
    let key = IdempotencyKey::parse(key).unwrap();
    let mut tx = T::Db::begin(db.pool()).await.unwrap();
    let Claim::Execute(execution) = claim(&mut tx, &request(tenant, operation, &key))
        .await
        .unwrap()
    else {
        panic!("a new key executes")
    };
    execution.complete(&mut tx, &answer()).await.unwrap();
    tx.commit().await.unwrap();
}

/// A leased execution of `key`, its lease live, owned by the lease returned.
async fn leased<T: EraseDb>(
    db: &T,
    tenant: &str,
    operation: &str,
    key: &str,
) -> idem_runtime::Lease<T::Db> {
    let key = IdempotencyKey::parse(key).unwrap();
    let req = LeaseRequest {
        tenant,
        operation,
        key: &key,
        fingerprint: FingerprintBuilder::new(tenant, operation, "POST", "/x").finish(),
        retention: Duration::from_secs(3600),
        lease: Duration::from_secs(30),
    };
    match claim_leased(db.pool(), &req).await.unwrap() {
        LeasedClaim::Acquired(lease) => lease,
        _ => panic!("a new key is acquired"),
    }
}

/// Rows of `tenant`.
async fn rows_of<T: EraseDb>(db: &T, tenant: &str) -> i64 {
    db.count(&format!(
        "SELECT count(*) FROM idempotency_requests WHERE tenant_id = '{tenant}'"
    ))
    .await
}

/// Tenant `acme`: four finished rows in two operations, a leased execution whose
/// lease lapsed, one whose lease is live and one whose outcome is uncertain;
/// tenant `globex`: a finished row and a live lease. The live leases come back
/// (acme's, globex's).
async fn populated<T: EraseDb>(db: &T) -> (idem_runtime::Lease<T::Db>, idem_runtime::Lease<T::Db>) {
    for key in ["k1", "k2", "k3"] {
        finished(db, "acme", "create-order", key).await;
    }
    finished(db, "acme", "refund", "r1").await;
    finished(db, "globex", "create-order", "k1").await;
    drop(leased(db, "acme", "lapsed", "gone").await);
    db.exec(T::LAPSE_LEASES).await;
    leased(db, "acme", "pay", "unsure")
        .await
        .mark_uncertain()
        .await
        .unwrap();
    let live = leased(db, "acme", "pay", "live").await;
    let other = leased(db, "globex", "pay", "live").await;
    (live, other)
}

async fn erasing_leaves_other_tenants_and_executions_in_flight<T: EraseDb>() {
    let db = T::create().await;
    let (live, _other) = populated(&db).await;
    // Batches of two: four rows to erase take three statements.
    let done = admin::erase_tenant(db.pool(), "acme", 2, InFlightRows::Keep)
        .await
        .unwrap();
    assert_eq!((done.erased, done.left), (4, 3), "{done:?}");
    assert_eq!(
        db.count(
            "SELECT count(*) FROM idempotency_requests \
              WHERE tenant_id = 'acme' AND state IN ('processing', 'uncertain')"
        )
        .await,
        3,
        "the live lease, the lapsed one and the uncertain row stay"
    );
    assert_eq!(
        rows_of(&db, "globex").await,
        2,
        "another tenant's rows stay"
    );
    let k1 = IdempotencyKey::parse("k1").unwrap();
    let gone = KeyAddress::of("acme", "create-order", &k1);
    assert!(
        admin::show(db.pool(), &gone, false)
            .await
            .unwrap()
            .is_none()
    );
    let kept = KeyAddress::of("globex", "create-order", &k1);
    assert!(
        admin::show(db.pool(), &kept, false)
            .await
            .unwrap()
            .is_some()
    );
    // The live execution finishes; erased again, its row goes.
    live.complete(&answer()).await.unwrap();
    let done = admin::erase_tenant(db.pool(), "acme", 2, InFlightRows::Keep)
        .await
        .unwrap();
    assert_eq!((done.erased, done.left), (1, 2), "{done:?}");
    // The lapsed lease and the uncertain row go only when asked for.
    let done = admin::erase_tenant(db.pool(), "acme", 2, InFlightRows::Erase)
        .await
        .unwrap();
    assert_eq!((done.erased, done.left), (2, 0), "{done:?}");
    assert_eq!(rows_of(&db, "acme").await, 0);
    assert_eq!(rows_of(&db, "globex").await, 2);
}

/// A leased execution whose lease lapsed (its worker died, its effect perhaps
/// done) survives an erasure that keeps executions in flight: the key's retry
/// takes it over and is told so, never `New`.
async fn a_lapsed_lease_survives_erasure_and_its_retry_is_a_takeover<T: EraseDb>() {
    let db = T::create().await;
    drop(leased(&db, "acme", "lapsed", "charge").await);
    db.exec(T::LAPSE_LEASES).await;
    let done = admin::erase_tenant(db.pool(), "acme", admin::ERASE_BATCH, InFlightRows::Keep)
        .await
        .unwrap();
    assert_eq!(counts(done), (0, 1), "the lapsed lease's row is left");
    let key = IdempotencyKey::parse("charge").unwrap();
    let req = LeaseRequest {
        tenant: "acme",
        operation: "lapsed",
        key: &key,
        fingerprint: FingerprintBuilder::new("acme", "lapsed", "POST", "/x").finish(),
        retention: Duration::from_secs(3600),
        lease: Duration::from_secs(30),
    };
    match claim_leased(db.pool(), &req).await.unwrap() {
        LeasedClaim::Acquired(lease) => assert_eq!(
            lease.acquisition(),
            idem_runtime::lease::Acquisition::TakenOver,
            "the retry knows an earlier attempt may have had its effect"
        ),
        other => panic!("expected a takeover, got {other:?}"),
    }
}

/// A key of an erased tenant executes anew: its row is gone, not hidden.
async fn a_key_of_an_erased_tenant_executes_anew<T: EraseDb>() {
    let db = T::create().await;
    finished(&db, "acme", "create-order", "k1").await;
    let done = admin::erase_tenant(db.pool(), "acme", admin::ERASE_BATCH, InFlightRows::Keep)
        .await
        .unwrap();
    assert_eq!(counts(done), (1, 0));
    let key = IdempotencyKey::parse("k1").unwrap();
    let mut tx = T::Db::begin(db.pool()).await.unwrap();
    let claimed = claim(&mut tx, &request("acme", "create-order", &key))
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Execute(_)), "{claimed:?}");
}

/// An empty tenant id names no row: refused, nothing deleted.
async fn an_empty_tenant_is_refused<T: EraseDb>() {
    let db = T::create().await;
    finished(&db, "acme", "create-order", "k1").await;
    let refused = admin::erase_tenant(db.pool(), "", 10, InFlightRows::Erase).await;
    assert!(
        matches!(refused, Err(StoreError::InvalidRequest(_))),
        "{refused:?}"
    );
    assert_eq!(rows_of(&db, "acme").await, 1);
}

/// What `erase_tenant` reported: erased, left.
fn counts(done: TenantErasure) -> (u64, u64) {
    (done.erased, done.left)
}

macro_rules! erase_tests {
    ($db:ty) => {
        #[tokio::test]
        async fn erasing_leaves_other_tenants_and_executions_in_flight() {
            super::erasing_leaves_other_tenants_and_executions_in_flight::<$db>().await
        }

        #[tokio::test]
        async fn a_lapsed_lease_survives_erasure_and_its_retry_is_a_takeover() {
            super::a_lapsed_lease_survives_erasure_and_its_retry_is_a_takeover::<$db>().await
        }

        #[tokio::test]
        async fn a_key_of_an_erased_tenant_executes_anew() {
            super::a_key_of_an_erased_tenant_executes_anew::<$db>().await
        }

        #[tokio::test]
        async fn an_empty_tenant_is_refused() {
            super::an_empty_tenant_is_refused::<$db>().await
        }
    };
}

mod postgres {
    use super::*;

    erase_tests!(common::TestDb);

    /// A row a running transaction holds is left and counted, and the erasure
    /// does not wait for it (`SKIP LOCKED`); once let go it is erased.
    #[tokio::test]
    async fn a_row_a_running_transaction_holds_is_left_not_waited_for() {
        held_row_is_left::<common::TestDb>().await
    }
}

mod sqlite {
    erase_tests!(crate::common::SqliteDb);
}

mod mysql {
    use super::*;

    erase_tests!(common::MySqlDb);

    #[tokio::test]
    async fn a_row_a_running_transaction_holds_is_left_not_waited_for() {
        held_row_is_left::<common::MySqlDb>().await
    }
}

/// PostgreSQL and MySQL lock rows (SQLite locks the database, and its writers
/// wait their turn).
async fn held_row_is_left<T: EraseDb>() {
    let db = T::create().await;
    finished(&db, "acme", "create-order", "k1").await;
    finished(&db, "acme", "create-order", "k2").await;
    let mut holder = T::Db::begin(db.pool()).await.unwrap();
    db.lock_key(&mut holder, "k1").await;
    let done = tokio::time::timeout(
        Duration::from_secs(30),
        admin::erase_tenant(db.pool(), "acme", 10, InFlightRows::Erase),
    )
    .await
    .expect("the erasure waits on no held row")
    .unwrap();
    assert_eq!(counts(done), (1, 1));
    holder.rollback().await.unwrap();
    let done = admin::erase_tenant(db.pool(), "acme", 10, InFlightRows::Keep)
        .await
        .unwrap();
    assert_eq!(counts(done), (1, 0));
}
