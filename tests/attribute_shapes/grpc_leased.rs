// Leased mode: the method holds a lease, reports an uncertain outcome with
// `grpc::uncertain`, and passes the downstream key on.
include!("../../idem-macros/tests/ui/grpc/prelude.rs");

#[tonic::async_trait]
impl Orders for Service {
    #[idempotent(
        operation = "create-order",
        retention = "24h",
        key = "metadata",
        lease = "30s"
    )]
    async fn create_order(
        &self,
        #[tenant] _caller: Extension<Caller>,
        lease: &mut Lease<Postgres>,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let _key: String = lease.downstream_key();
        if request.get_ref().quantity > 10 {
            return Err(idem_runtime::grpc::uncertain("the provider timed out"));
        }
        Ok(Response::new(Order { id: 1 }))
    }
}

#[test]
fn serves_the_service() {
    fn serves<S: Orders>() {}
    serves::<Service>();
}
