//! Keys at rest on every database, written once against the enclosing
//! database module's `TestDb` (a fresh database of that kind) and its SQL:
//! `LEGACY_ROW`, an older release's row (binds: $1 tenant, $2 operation,
//! $3 raw key, $4 fingerprint, $5 state, $6 status, $7 headers JSON, $8 body,
//! $9 owner token), `OWNER_TOKEN` in that database's spelling, and
//! `ROWS_CONTAINING`, the rows in whose text (every column that could hold
//! one) its one bind occurs. `tests/key_digest.rs` mounts this file in each
//! database's module and stamps a `#[tokio::test]` wrapper per test there.

use super::*;

/// Writes a row as an older release (raw keys) did.
pub(super) async fn insert_legacy(
    db: &TestDb,
    tenant: &str,
    operation: &str,
    key: &str,
    fingerprint: Fingerprint,
    state: &str,
    token: Option<&str>,
) {
    let finished = state == "completed";
    sqlx::query(LEGACY_ROW)
        .bind(tenant)
        .bind(operation)
        .bind(key)
        .bind(&fingerprint.as_bytes()[..])
        .bind(state)
        .bind(finished.then_some(201_i32))
        .bind(finished.then_some(r#"[["content-type","application/json"]]"#))
        .bind(finished.then_some(LEGACY_BODY.as_bytes()))
        .bind(token)
        .execute(&db.pool)
        .await
        .unwrap();
}

/// The completed row [`insert_legacy`] wrote under `key` is replayed to a
/// claim with its fingerprint.
pub(super) async fn assert_legacy_replays(db: &TestDb, key: &IdempotencyKey, fp: Fingerprint) {
    let mut tx = db.pool.begin().await.unwrap();
    match claim(&mut tx, &request(key, fp)).await.unwrap() {
        Claim::Replay(StoredResponse { status, body, .. }) => {
            assert_eq!((status, &body[..]), (201, LEGACY_BODY.as_bytes()));
        }
        other => panic!("the legacy outcome was not replayed: {other:?}"),
    }
    tx.rollback().await.unwrap();
}

async fn rows_containing(db: &TestDb, text: &str) -> i64 {
    sqlx::query_scalar(ROWS_CONTAINING)
        .bind(text)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// A completed row and an uncertain leased one, written by a release
/// that stored raw keys, survive the migration: the completed one
/// replays (and refuses another request), the uncertain one is
/// reconciled under the downstream key it was charged with, and no raw
/// key is left.
pub async fn rows_of_an_older_release_are_found_after_the_migration() {
    let db = TestDb::migrated_before(KEY_DIGEST_MIGRATION).await;
    let done = IdempotencyKey::parse("legacy-done-SECRET").unwrap();
    // A structured-field key: its characters include a space.
    let unknown = IdempotencyKey::parse(r#""legacy unknown SECRET""#).unwrap();
    let fp = fingerprint("a");
    insert_legacy(
        &db,
        "acme",
        "create-order",
        done.as_str(),
        fp,
        "completed",
        None,
    )
    .await;
    insert_legacy(
        &db,
        UNCERTAIN_TENANT,
        UNCERTAIN_OPERATION,
        unknown.as_str(),
        fp,
        "uncertain",
        Some(OWNER_TOKEN),
    )
    .await;

    idem_runtime::migrate(&db.pool).await.unwrap();
    // Idempotent: a second start converts nothing twice.
    idem_runtime::migrate(&db.pool).await.unwrap();

    assert_eq!(
        rows_containing(&db, "SECRET").await,
        0,
        "no raw key is left"
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM idempotency_requests WHERE key_digest = {}",
            db.key(done.as_str())
        ))
        .await,
        1
    );

    assert_legacy_replays(&db, &done, fp).await;
    let mut tx = db.pool.begin().await.unwrap();
    let other = claim(&mut tx, &request(&done, fingerprint("b")))
        .await
        .unwrap();
    assert!(matches!(other, Claim::Mismatch), "{other:?}");
    tx.rollback().await.unwrap();

    let recorder = Recorder::default();
    let report = Reconciler::new(db.pool.clone(), recorder.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.still_uncertain, 1, "{report:?}");
    let asked = recorder.0.lock().unwrap().clone();
    assert_eq!(asked.len(), 1);
    assert_eq!(
        asked[0].downstream_key,
        idem_runtime::lease::downstream_key(UNCERTAIN_TENANT, UNCERTAIN_OPERATION, &unknown),
        "the downstream key the old release charged under"
    );
    assert_eq!(asked[0].key_digest, unknown.digest());
}

/// What a request stores holds the key's digest, and nowhere the key.
pub async fn a_claimed_key_is_stored_as_its_digest_only() {
    let db = TestDb::new().await;
    let key = IdempotencyKey::parse("sk_live_SECRET_42").unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let Claim::Execute(execution) = claim(&mut tx, &request(&key, fingerprint("a")))
        .await
        .unwrap()
    else {
        panic!("a new key executes");
    };
    let stored = StoredResponse {
        status: 201,
        headers: vec![],
        body: "ok".into(),
    };
    execution.complete(&mut tx, &stored).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(rows_containing(&db, "SECRET").await, 0);
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM idempotency_requests WHERE key_digest = {}",
            db.key(key.as_str())
        ))
        .await,
        1
    );
}
