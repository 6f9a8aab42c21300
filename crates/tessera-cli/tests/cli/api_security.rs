//! Issue 11, items 9 and 10 (management API): the API on hyper/axum speaks full HTTP/1.1
//! on its private Unix socket (chunked bodies, HEAD, JSON errors for 405/413/400), serves
//! its OpenAPI document, is served on TCP only with TLS and bearer tokens, and writes one
//! audit line per mutating call.

use crate::common;
use common::*;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "6f0c1d2e3b4a59687766554433221100ffeeddccbbaa99887766554433221100";
const WRONG: &str = "6f0c1d2e3b4a59687766554433221100ffeeddccbbaa99887766554433221101";

/// A CA and a certificate for 127.0.0.1 signed by it, and a token file, in `dir`.
fn make_credentials(dir: &Path) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tessera test CA");
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("# operators\nops:{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o600)).unwrap();
    // What a client keeps: the token alone.
    let client = dir.join("client-token");
    std::fs::write(&client, format!("{TOKEN}\n")).unwrap();
    std::fs::set_permissions(&client, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// `curl ARGS`: (HTTP status, response headers, body). Status 0: no HTTP answer.
fn curl(args: &[&str]) -> (u16, String, String) {
    let dir = temp_dir("curl");
    let headers = dir.path().join("headers");
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "20",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "-D",
        ])
        .arg(&headers)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (
        code.trim().parse().unwrap_or(0),
        std::fs::read_to_string(&headers).unwrap_or_default(),
        body.to_string(),
    )
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

/// The node's audit lines, waiting (bounded) until `want` of them are there.
fn audit_lines(n: &TestNode, want: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines: Vec<String> = n
            .log_text()
            .lines()
            .filter(|l| l.contains("tessera::audit") && l.contains("api call"))
            .map(str::to_string)
            .collect();
        if lines.len() >= want || Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn cli(args: &[&str], env_token: Option<&str>) -> Output {
    let mut c = Command::new(BIN);
    c.args(args)
        .stdin(Stdio::null())
        .env_remove("TESSERA_TOKEN");
    if let Some(t) = env_token {
        c.env("TESSERA_TOKEN", t);
    }
    c.output().expect("run tessera")
}

#[test]
fn unix_socket_is_private_and_speaks_full_http() {
    if !require_tool("curl") {
        return;
    }
    let n = TestNode::start_default("api-unix");
    let sock = n.data_dir.join("api.sock");
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the API socket's mode is {mode:o}");
    let s = sock.to_str().unwrap();
    let url = |p: &str| format!("http://localhost{p}");

    // A chunked request body (curl sends one when told to).
    let (code, _, body) = curl(&[
        "--unix-socket",
        s,
        "-X",
        "POST",
        "-H",
        "Transfer-Encoding: chunked",
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        r#"{"name": "chunky", "pool": "pool0", "size": "64M"}"#,
        &url("/v1/volumes"),
    ]);
    assert_eq!(code, 201, "{body}");
    assert_eq!(json(&body)["name"], "chunky");

    // HEAD: the GET's status and headers, no body.
    let (code, headers, body) = curl(&["--unix-socket", s, "-I", &url("/v1/status")]);
    assert_eq!(code, 200, "{headers}");
    // `curl -I` prints the head where the body would go: nothing may follow it.
    assert_eq!(body.split("\r\n\r\n").nth(1), Some(""), "{body:?}");
    assert!(
        headers
            .to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{headers}"
    );

    // Wrong method, unknown route, malformed JSON, oversize body: JSON errors.
    let (code, _, body) = curl(&["--unix-socket", s, "-X", "PUT", &url("/v1/status")]);
    assert_eq!(code, 405, "{body}");
    assert!(
        json(&body)["error"]
            .as_str()
            .unwrap()
            .contains("not allowed"),
        "{body}"
    );
    let (code, _, body) = curl(&["--unix-socket", s, &url("/v1/nothing")]);
    assert_eq!(code, 404, "{body}");
    assert!(json(&body)["error"].is_string());
    let (code, _, body) = curl(&[
        "--unix-socket",
        s,
        "-X",
        "POST",
        "--data-binary",
        "{\"name\": ",
        &url("/v1/volumes"),
    ]);
    assert_eq!(code, 400, "{body}");
    assert!(
        json(&body)["error"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"),
        "{body}"
    );
    let big = n.dir.join("big.json");
    std::fs::write(&big, format!("\"{}\"", "x".repeat(2 << 20))).unwrap();
    let (code, _, body) = curl(&[
        "--unix-socket",
        s,
        "-X",
        "POST",
        "--data-binary",
        &format!("@{}", big.display()),
        &url("/v1/volumes"),
    ]);
    assert_eq!(code, 413, "{body}");
    assert!(
        json(&body)["error"].as_str().unwrap().contains("exceeds"),
        "{body}"
    );

    // The OpenAPI document names every route, the rebuild ones included.
    let (code, _, body) = curl(&["--unix-socket", s, &url("/openapi.json")]);
    assert_eq!(code, 200);
    let doc = json(&body);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{body}");
    for route in [
        "/v1/status",
        "/v1/pools/{name}/rebuild",
        "/v1/volumes/{name}/stats",
    ] {
        assert!(doc["paths"][route].is_object(), "{route} missing");
    }

    // One audit line per mutating call, naming the client and the resources, never for a
    // GET or HEAD. (The PUT, the bad POST and the oversize POST are mutating calls too.)
    let lines = audit_lines(&n, 4);
    assert_eq!(lines.len(), 4, "{lines:#?}");
    let create = &lines[0];
    for want in [
        "method=\"POST\"",
        "path=\"/v1/volumes\"",
        "name=chunky pool=pool0",
        "client=\"unix uid=",
        "status=201",
        "duration_ms=",
    ] {
        assert!(create.contains(want), "{want} not in {create}");
    }
    assert!(
        lines[1].contains("method=\"PUT\"") && lines[1].contains("status=405"),
        "{lines:#?}"
    );
    assert!(lines[2].contains("status=400"), "{lines:#?}");
    assert!(lines[3].contains("status=413"), "{lines:#?}");
}

#[test]
fn tcp_api_is_refused_without_tls_and_a_token() {
    let tmp = temp_dir("api-plain-tcp");
    let cfg = tmp.path().join("tessera.toml");
    let data = tmp.path().join("data");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = \"{}\"\ncores = 1\n[nbd]\nlisten = []\n[api]\ntcp = \"127.0.0.1:{}\"\n[[pool]]\nname = \"p\"\ndevices = [\"ram:64M\"]\n",
            data.display(),
            free_port()
        ),
    )
    .unwrap();
    let mut child = Command::new(BIN)
        .args(["node", "--config"])
        .arg(&cfg)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a node with a plain-text TCP API did not refuse to start");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success());
    assert!(
        err.contains("needs TLS and authentication") && err.contains("api.token_file"),
        "{err}"
    );
    // Refused before anything was opened: no pool was created.
    assert!(!data.join("pools.json").exists());
}

#[test]
fn tcp_api_needs_tls_and_a_valid_token() {
    if !require_tool("curl") {
        return;
    }
    let creds = temp_dir("api-creds");
    let c = creds.path();
    make_credentials(c);
    let port = free_port();
    let p = |name: &str| -> PathBuf { c.join(name) };
    let n = TestNode::start_with_config(
        "api-tls",
        &format!(
            "[api]\ntcp = \"127.0.0.1:{port}\"\ntls_cert = \"{}\"\ntls_key = \"{}\"\ntoken_file = \"{}\"\n[[pool]]\nname = \"p\"\ndevices = [\"ram:256M\"]\n",
            p("cert.pem").display(),
            p("key.pem").display(),
            p("tokens").display()
        ),
    );
    let ca = p("ca.pem");
    let ca = ca.to_str().unwrap();
    let url = format!("https://127.0.0.1:{port}/v1/status");

    let (code, headers, body) = curl(&["--cacert", ca, &url]);
    assert_eq!(code, 401, "no token: {body}");
    assert!(
        headers
            .to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{headers}"
    );
    assert!(json(&body)["error"].is_string());
    let wrong = format!("Authorization: Bearer {WRONG}");
    let (code, headers, _) = curl(&["--cacert", ca, "-H", &wrong, &url]);
    assert_eq!(code, 401, "wrong token");
    assert!(
        headers
            .to_ascii_lowercase()
            .contains("www-authenticate: bearer"),
        "{headers}"
    );
    let right = format!("Authorization: Bearer {TOKEN}");
    let (code, _, body) = curl(&["--cacert", ca, "-H", &right, &url]);
    assert_eq!(code, 200, "{body}");
    assert!(json(&body)["pools"].is_array(), "{body}");

    // Plain HTTP to the TLS port gets no HTTP answer.
    let (code, _, _) = curl(&[&format!("http://127.0.0.1:{port}/v1/status")]);
    assert_ne!(code, 200);
    assert_ne!(code, 401);

    // The CLI over HTTPS: a token file, or $TESSERA_TOKEN; without one it is refused.
    let api = format!("https://127.0.0.1:{port}");
    let token_file = p("client-token");
    let o = cli(
        &[
            "--api",
            &api,
            "--ca-cert",
            ca,
            "--token-file",
            token_file.to_str().unwrap(),
            "volume",
            "create",
            "tv",
            "--pool",
            "p",
            "--size",
            "64M",
        ],
        None,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = cli(
        &["--api", &api, "--ca-cert", ca, "--json", "volume", "list"],
        Some(TOKEN),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("\"tv\""));
    let o = cli(&["--api", &api, "--ca-cert", ca, "status"], None);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("authentication required"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = cli(
        &["--api", &api, "--ca-cert", ca, "volume", "delete", "tv"],
        Some(WRONG),
    );
    assert!(!o.status.success());

    // The audit lines: the TCP client by address and token name, the refused call too,
    // and never the token.
    let lines = audit_lines(&n, 2);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        lines[0].contains("method=\"POST\"") && lines[0].contains("name=tv"),
        "{lines:#?}"
    );
    assert!(
        lines[0].contains("client=\"tcp 127.0.0.1:") && lines[0].contains("token=\"ops\""),
        "{lines:#?}"
    );
    assert!(lines[0].contains("status=201"), "{lines:#?}");
    assert!(
        lines[1].contains("method=\"DELETE\"") && lines[1].contains("status=401"),
        "{lines:#?}"
    );
    assert!(lines[1].contains("resources=\"name=tv\""), "{lines:#?}");
    let log = n.log_text();
    assert!(
        !log.contains(TOKEN) && !log.contains(WRONG),
        "a token reached the log"
    );
}
