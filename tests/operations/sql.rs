//! What only a SQL store shows, mounted beside `suite.rs` in the SQL stores'
//! modules (they set `SqlDb`, the test database's type, and `NOW`, the
//! database's clock as idem writes it): a finished row past its retention is
//! kept until the sweeper deletes it, and its resource is gone at once.

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
