// The transaction after the request, as an HTTP handler may place it: refused
// at the request with where it goes, not with an HTTP handler's errors.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[tonic::async_trait]
impl Orders for Service {
    #[idempotent(operation = "create-order", retention = "24h", key = "metadata")]
    async fn create_order(&self, #[tenant] caller: Extension<Caller>, request: Request<CreateOrderRequest>, tx: &mut Tx<Postgres>) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order { id: 1 }))
    }
}

fn main() {}
