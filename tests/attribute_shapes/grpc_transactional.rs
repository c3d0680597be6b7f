// A method inside the service's `#[tonic::async_trait]` impl, its key in the
// `idempotency-key` metadata entry, the tenant from an interceptor's extension,
// `self` reached in the body.
include!("../../idem-macros/tests/ui/grpc/prelude.rs");

#[tonic::async_trait]
impl Orders for Service {
    #[idempotent(operation = "create-order", retention = "24h", key = "metadata")]
    async fn create_order(
        &self,
        #[tenant] caller: Extension<Caller>,
        tx: &mut Tx<Postgres>,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let _idem = &self.idem;
        let id: i64 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        if request.get_ref().quantity < 1 {
            return Err(Status::invalid_argument("quantity"));
        }
        Ok(Response::new(Order { id }))
    }
}

#[test]
fn serves_the_service() {
    fn serves<S: Orders>() {}
    serves::<Service>();
}
