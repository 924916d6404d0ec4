//! mTLS on the control listener (`[control.tls]`): a client certificate
//! from the configured CA names its principal by SAN (no token needed); a
//! client without a certificate goes on to bearer tokens; a certificate
//! from another CA fails the handshake; one from the CA that names no
//! principal is `401` without a token. A private PKI made in the test,
//! loopback only.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use egress_config::principals::token_hash;
use egress_e2e::harness::{proxy_section, TestProxy, TOKEN};
use egress_e2e::pki::{https_call, Ca};
use egress_e2e::FakeDns;
use egress_proxy::facts::MemorySink;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

#[tokio::test]
async fn client_certificates_name_principals_and_other_cas_fail_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("control CA");
    let rogue = Ca::new("rogue CA");
    let ca_file = ca.write(d, "ca.pem");
    let server = ca.leaf(d, "server", "control", &["127.0.0.1"]);
    let kernel = ca.leaf(d, "kernel-a", "kernel-a", &["kernel-a.kernels.test"]);
    let stranger = ca.leaf(d, "stranger", "stranger", &["stranger.kernels.test"]);
    let forged = rogue.leaf(d, "forged", "kernel-a", &["kernel-a.kernels.test"]);
    let principals = d.join("principals.toml");
    std::fs::write(
        &principals,
        format!(
            "[principals.kernel-a]\nsubjects = [\"kernel-a.kernels.test\"]\nscopes = [\"runs:*\", \"facts:own\"]\n\n\
             [principals.kernel-b]\ntokens = [\"{}\"]\nscopes = [\"runs:*\"]\n",
            token_hash("kernel-b-token-0123456789abcdef")
        ),
    )
    .unwrap();
    std::fs::set_permissions(&principals, std::fs::Permissions::from_mode(0o600)).unwrap();
    let dns = FakeDns::start().await;
    let text = format!(
        "{}\n[control]\nprincipals_file = \"{}\"\n[control.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n[tools.search]\negress = []\n",
        proxy_section(&dns, ""),
        principals.display(),
        server.cert.display(),
        server.key.display(),
        ca_file.display()
    );
    let p = TestProxy::start_config(dns, &text, None, Some(Arc::new(MemorySink::new(1000)))).await;
    let call = |client, path: &'static str, body: Option<Value>, token: Option<&'static str>| {
        let method = if body.is_some() { "POST" } else { "GET" };
        https_call(p.control, &ca_file, client, method, path, body, token)
    };
    // The certificate is the credential: kernel-a, with no token.
    let r = call(Some(&kernel), "/v1/runs", Some(json!({"tool": "search"})), None)
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["principal"], "kernel-a", "{v}");
    // Without a certificate: tokens, as before.
    assert_eq!(call(None, "/v1/runs", None, None).await.unwrap().status, 401);
    assert_eq!(call(None, "/v1/runs", None, Some(TOKEN)).await.unwrap().status, 200);
    let r = call(None, "/v1/runs", None, Some("kernel-b-token-0123456789abcdef"))
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert!(
        !r.text().contains("kernel-a"),
        "kernel-b sees its own runs only: {}",
        r.text()
    );
    // From the CA, naming nobody: no principal without a token.
    assert_eq!(call(Some(&stranger), "/v1/runs", None, None).await.unwrap().status, 401);
    // Another CA: the handshake fails, whatever the names.
    let e = call(Some(&forged), "/v1/runs", None, Some(TOKEN)).await.unwrap_err();
    assert!(!e.is_empty(), "refused at the handshake: {e}");
}
