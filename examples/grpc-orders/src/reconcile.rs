//! The reconciler of uncertain payments: it asks the provider (its charges
//! table) whether a charge was made under the payment's downstream key, and
//! stores the `Payment` a retry then replays, or releases the key.

use idem_runtime::reconcile::{Reconcile, Resolution, UncertainOutcome};
use sqlx::Pool;

use crate::pb::Payment;
use crate::store::Store;

/// Asks the provider's charges table.
pub struct AskProvider<DB: Store> {
    pub pool: Pool<DB>,
}

impl<DB: Store> Reconcile for AskProvider<DB> {
    fn operation(&self) -> &str {
        "create-payment"
    }

    async fn reconcile(&self, outcome: &UncertainOutcome) -> Resolution {
        match DB::find_charge(&self.pool, &outcome.downstream_key).await {
            Ok(Some((charge_id, amount_cents))) => {
                Resolution::Completed(idem_runtime::grpc::stored_message(&Payment {
                    charge_id,
                    amount_cents,
                }))
            }
            Ok(None) => Resolution::Released,
            Err(e) => {
                tracing::warn!(error = %e, "grpc-orders: cannot ask the provider");
                Resolution::StillUncertain
            }
        }
    }
}
