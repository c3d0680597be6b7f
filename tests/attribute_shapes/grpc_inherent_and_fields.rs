// On an inherent method the trait's method delegates to (an `async fn`, not
// rewritten by async_trait): the key a field of the message (AIP-155), the
// fingerprint two fields and a metadata entry, one tenant.
include!("../../idem-macros/tests/ui/grpc/prelude.rs");

impl Service {
    #[idempotent(
        operation = "create-order",
        retention = "24h",
        key = "body.request_id",
        fingerprint(body.sku, body.quantity, header = "x-currency"),
        single_tenant
    )]
    async fn create(
        &self,
        tx: &mut Tx<Postgres>,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let _ = (&self.idem, &mut **tx);
        let quantity = i64::from(request.into_inner().quantity);
        Ok(Response::new(Order { id: quantity }))
    }
}

#[tonic::async_trait]
impl Orders for Service {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        self.create(request).await
    }
}

#[test]
fn serves_the_service() {
    fn serves<S: Orders>() {}
    serves::<Service>();
}
