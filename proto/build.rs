//! Generates kubelet's device plugin, PodResources, DRA plugin and plugin registration APIs with the pure-Rust `protox`
//! compiler, so building needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/deviceplugin/v1beta1/api.proto",
        "proto/podresources/v1/api.proto",
        "proto/dra/v1/api.proto",
        "proto/pluginregistration/v1/api.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
