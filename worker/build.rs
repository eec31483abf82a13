//! Generates the control plane's gRPC service (tonic, from a Rust description: no protoc). Its
//! messages are opaque bytes (`control::codec::BytesCodec`): Raft messages as raft-rs encodes
//! them, admin requests as JSON.

fn main() {
    let method = |name: &str, route: &str| {
        tonic_build::manual::Method::builder()
            .name(name)
            .route_name(route)
            .input_type("::std::vec::Vec<u8>")
            .output_type("::std::vec::Vec<u8>")
            .codec_path("crate::control::codec::BytesCodec")
            .build()
    };
    let service = tonic_build::manual::Service::builder()
        .name("Control")
        .package("shimmer.control.v1")
        .method(method("raft", "Raft"))
        .method(method("admin", "Admin"))
        .build();
    tonic_build::manual::Builder::new().build_transport(false).compile(&[service]);
}
