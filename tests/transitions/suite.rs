//! What every database must do alike with a transition, written once against
//! the enclosing database module's `Db` (its sqlx database) and `TestDb` (a
//! fresh database of that kind). `tests/transitions.rs` mounts this file in
//! each database's module and stamps a `#[tokio::test]` wrapper per test
//! there; `db` and `go` are also what the tests beside it use.

use super::*;

/// A fresh database with one order, `created`, at version 1.
pub async fn db() -> TestDb {
    let db = TestDb::new().await;
    db.exec(DDL).await;
    db
}

pub async fn go(tx: &mut Transaction<'_, Db>, to: Step) -> Outcome {
    transition(tx, &ORDERS, 1, Some("acme"), to, |c| {
        Box::pin(async move {
            sqlx::query("INSERT INTO payments VALUES (1)")
                .execute(&mut *c)
                .await?;
            Ok(())
        })
    })
    .await
}

pub async fn a_repeated_transition_is_a_no_op_success() {
    let db = db().await;
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        go(&mut tx, Step::Paid).await.unwrap(),
        Transitioned::Applied {
            value: (),
            version: 2
        }
    );
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        go(&mut tx, Step::Paid).await.unwrap(),
        Transitioned::AlreadyThere { version: 2 }
    );
    tx.commit().await.unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM payments").await,
        1,
        "the action ran once"
    );
}

pub async fn an_invalid_transition_is_a_typed_error() {
    let db = db().await;
    let mut tx = db.pool.begin().await.unwrap();
    match go(&mut tx, Step::Shipped).await {
        Err(TransitionError::Invalid {
            from: Step::Created,
            to: Step::Shipped,
        }) => {}
        other => panic!("expected Invalid, got {other:?}"),
    }
    drop(tx);
    let mut other_tenant = db.pool.begin().await.unwrap();
    let missing = transition(
        &mut other_tenant,
        &ORDERS,
        1,
        Some("globex"),
        Step::Paid,
        |_| Box::pin(async { Ok::<(), sqlx::Error>(()) }),
    )
    .await;
    assert!(matches!(missing, Err(TransitionError::NotFound)));
    drop(other_tenant);
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 0);
}

pub async fn an_unscoped_resource_is_found_by_id_alone() {
    let db = db().await;
    let unscoped = Resource {
        scope_column: None,
        ..ORDERS
    };
    let mut tx = db.pool.begin().await.unwrap();
    let r = transition(&mut tx, &unscoped, 1, None, Step::Paid, |_| {
        Box::pin(async { Ok::<(), sqlx::Error>(()) })
    })
    .await;
    assert!(
        matches!(r, Ok(Transitioned::Applied { version: 2, .. })),
        "{r:?}"
    );
}

pub async fn a_scope_that_does_not_fit_the_resource_is_an_error_not_a_miss() {
    let db = db().await;
    let unscoped = Resource {
        scope_column: None,
        ..ORDERS
    };
    let mut tx = db.pool.begin().await.unwrap();
    let r = transition(&mut tx, &unscoped, 1, Some("acme"), Step::Paid, |_| {
        Box::pin(async { Ok::<(), sqlx::Error>(()) })
    })
    .await;
    assert!(
        matches!(
            r,
            Err(TransitionError::ScopeMismatch {
                scoped: "not scoped",
                ..
            })
        ),
        "{r:?}"
    );
    let r = transition(&mut tx, &ORDERS, 1, None, Step::Paid, |_| {
        Box::pin(async { Ok::<(), sqlx::Error>(()) })
    })
    .await;
    assert!(
        matches!(
            r,
            Err(TransitionError::ScopeMismatch {
                scoped: "scoped",
                ..
            })
        ),
        "{r:?}"
    );
    drop(tx);
    assert_eq!(db.count("SELECT count(*) FROM payments").await, 0);
}

pub async fn a_writer_that_bypasses_the_lock_is_fenced_by_the_version() {
    let db = db().await;
    let mut tx = db.pool.begin().await.unwrap();
    // The action itself moves the version, as a writer outside the helper would.
    let r: Outcome = transition(&mut tx, &ORDERS, 1, Some("acme"), Step::Paid, |c| {
        Box::pin(async move {
            sqlx::query("UPDATE orders SET version = version + 1 WHERE id = 1")
                .execute(&mut *c)
                .await?;
            Ok(())
        })
    })
    .await;
    assert!(matches!(r, Err(TransitionError::Conflict)), "{r:?}");
}
