//! What only a SQL store shows, mounted beside `suite.rs` in the SQL stores'
//! modules (they set `SqlDb`, the test database's type, and `NOW`, the
//! database's clock as idem writes it): a finished row past its retention is
//! kept until the sweeper deletes it, and its resource is gone at once; a
//! claim that cannot read the key's row is told to retry.

use super::suite::*;
use super::*;

pub async fn a_finished_operation_past_its_retention_is_gone_and_runs_anew() {
    let s = setup("expired").await;
    let location = send(&s.router, export("k-11", "ok", false))
        .await
        .location();
    settled(&s).await;
    assert_eq!(status_of(&s, &location).await.status, Status::Succeeded);
    let db = s._keep.downcast_ref::<SqlDb>().unwrap();
    db.exec(&format!(
        "UPDATE idempotency_requests SET expires_at = {NOW}"
    ))
    .await;
    let gone = send(&s.router, get_as("acme", &location)).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    let again = send(&s.router, export("k-11", "ok", false)).await;
    assert_eq!(again.status, StatusCode::ACCEPTED, "executed anew");
    settled(&s).await;
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 2);
    assert_eq!(
        db.count("SELECT generation FROM idempotency_requests")
            .await,
        2,
        "reclaimed"
    );
}

/// Another request under a running operation's key, whose claim cannot read
/// the key's row (another transaction holds it: on PostgreSQL past 200 ms,
/// on MySQL past its lock wait; on SQLite the write lock, past the busy
/// timeout), is told to retry: never `202` with the running operation's
/// address, whose result a client following it would take for its own. Once
/// the row can be read, it is `422`.
pub async fn a_request_whose_claim_reads_nothing_is_not_given_the_operation() {
    let mut s = setup("contended").await;
    send(&s.router, export("k-12", "ok", true)).await;
    s.entered.recv().await.unwrap();
    let db = s._keep.downcast_ref::<SqlDb>().unwrap();
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE idempotency_requests SET generation = generation")
        .execute(&mut *holder)
        .await
        .unwrap();
    let other = send(&s.router, export("k-12", "refuse", true)).await;
    assert!(
        matches!(
            other.status,
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
        ),
        "{:?}: {}",
        other.status,
        String::from_utf8_lossy(&other.body)
    );
    assert!(
        !other.headers.contains_key("location"),
        "{:?}",
        other.headers
    );
    assert!(other.headers.contains_key("retry-after"));
    holder.rollback().await.unwrap();
    let other = send(&s.router, export("k-12", "refuse", true)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    s.app.release.add_permits(1);
    settled(&s).await;
    assert_eq!(s.app.runs.load(Ordering::SeqCst), 1);
}
