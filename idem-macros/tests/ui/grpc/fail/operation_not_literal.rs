// The operation is a string literal, fixed at compile time.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");
const OPERATION: &str = "create-order";
#[tonic::async_trait]
impl Orders for Service {
    #[idempotent(operation = OPERATION, retention = "24h", key = "metadata")]
    async fn create_order(&self, #[tenant] caller: Extension<Caller>, tx: &mut Tx<Postgres>, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order { id: 1 }))
    }
}

fn main() {}
