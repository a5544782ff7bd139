//! Asks istiod's CA (or a stand-in) for one certificate with ztunnel's variables (`CA_ADDRESS`, `CA_ROOT_CA`,
//! `ALT_CA_HOSTNAME`, `AUTH_TOKEN`, `SECRET_TTL`, …) and prints what came back; `CA_PROBE_IDENTITY` names the
//! identity (`spiffe://…`). Exits 1 if no verified certificate was obtained. Used by `mesh-ca/interop/run.sh`.

use std::collections::BTreeMap;

use mesh_ca::client::CaClient;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let vars: BTreeMap<String, String> = std::env::vars().collect();
    let identity = vars.get("CA_PROBE_IDENTITY").cloned().unwrap_or_default();
    let result = async {
        let identity: hbone::identity::Identity = identity.parse().map_err(|e| format!("CA_PROBE_IDENTITY: {e}"))?;
        let client = CaClient::from_env(&vars, |p| p.exists())?.ok_or("CA_ADDRESS is empty")?;
        client.fetch(&identity).await.map_err(|e| e.to_string())
    }
    .await;
    match result {
        Ok(cert) => {
            println!(
                "certificate for {}: serial {}, issuer {}, valid {:?} .. {:?}, {} in chain, {} root(s)",
                cert.identity(),
                cert.serial(),
                cert.issuer(),
                cert.not_before(),
                cert.not_after(),
                cert.chain().len(),
                cert.roots().len()
            );
        }
        Err(e) => {
            eprintln!("ca_probe: {e}");
            std::process::exit(1);
        }
    }
}
