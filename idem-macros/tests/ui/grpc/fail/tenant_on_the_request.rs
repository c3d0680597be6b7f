// The request message marked `#[tenant]`: refused at the mark, once (not
// also "no tenant" at the method's name).
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[tonic::async_trait]
impl Orders for Service {
    #[idempotent(operation = "create-order", retention = "24h", key = "metadata")]
    async fn create_order(&self, tx: &mut Tx<Postgres>, #[tenant] request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order { id: 1 }))
    }
}

fn main() {}
