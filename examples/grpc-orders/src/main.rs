//! `cargo run -p grpc-orders`: see the library's documentation for the
//! environment it reads.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match grpc_orders::server::run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("grpc-orders: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
