// `#[tenant]` on the transaction: refused at the mark, once (not also "no
// tenant" at the method's name), as on an HTTP handler.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[tonic::async_trait]
impl Orders for Service {
    #[idempotent(operation = "create-order", retention = "24h", key = "metadata")]
    async fn create_order(&self, #[tenant] tx: &mut Tx<Postgres>, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order { id: 1 }))
    }
}

fn main() {}
