//! Compiles `proto/orders.proto` into the service's messages, server and
//! client with protox, a protobuf compiler written in Rust: a fresh machine
//! builds the example without `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/orders.proto");
    let descriptors = protox::compile(["orders.proto"], ["proto"])?;
    tonic_prost_build::configure()
        // Maps are encoded in key order, so that a message's canonical encoding,
        // which idem fingerprints, does not depend on a hash map's order.
        .btree_map(".")
        .compile_fds(descriptors)?;
    Ok(())
}
