// A client-streaming method: one fingerprinted message per call is what idem
// makes idempotent.
#![allow(unused_imports, unused_variables, dead_code)]
include!("../prelude.rs");

#[tonic::async_trait]
impl Orders for Service {
    async fn create_order(&self, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order { id: 1 }))
    }

    #[idempotent(operation = "import-orders", retention = "24h", key = "metadata", fingerprint(ignore_body))]
    async fn import_orders(&self, #[tenant] caller: Extension<Caller>, tx: &mut Tx<Postgres>, request: Request<tonic::Streaming<CreateOrderRequest>>) -> Result<Response<Order>, Status> {
        Ok(Response::new(Order { id: 1 }))
    }
}

fn main() {}
