//! The data plane's QUIC endpoints (quinn, TLS 1.3, ALPN `shimmer/1`) and how two nodes know
//! each other: a cluster join token, proven on every connection. Each side sends
//! HMAC-SHA256(token, an exporter secret of this TLS session and its role) and checks the other's:
//! the proof is bound to the session (RFC 5705/8446 exporters), so it cannot be replayed on another
//! connection or relayed by a man in the middle, whose two sessions would have different secrets.
//! With that proof, a node's certificate needs no CA: each presents a fresh self-signed one.
//!
//! The other way in is operator-supplied mutual TLS (`--tls-cert/--tls-key/--tls-ca`): both sides
//! present a certificate chain that must verify against the operator's CA (a worker's for the IP
//! address the coordinator dials), and the handshake itself refuses strangers. Given both, a
//! connection must pass both.
//!
//! Must never: let a stream carry work before the connection's credentials checked out, or
//! compare proofs in variable time.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};

pub const ALPN: &[u8] = b"shimmer/1";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-shimmer/1 join";
const PROOF_LEN: usize = 32;
/// The application close code for a failed proof.
pub const CLOSE_AUTH_FAILED: u32 = 0x5348_0001;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{0}")]
    WeakToken(shimmer_control::token::TokenError),
    #[error("TLS setup: {0}")]
    Tls(String),
    #[error("cannot open a QUIC endpoint on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("cannot find worker address {addr}: {reason}")]
    Resolve { addr: String, reason: String },
    #[error("the peer did not prove the cluster's join token (wrong token, or not a shimmer node)")]
    Refused,
    #[error("authentication with {peer} failed: {reason}")]
    Handshake { peer: SocketAddr, reason: String },
    #[error("{path}: {reason}")]
    Certificate { path: String, reason: String },
    #[error("no worker can be reached: {0}")]
    NoWorkers(String),
    #[error("a cluster link needs a join token or operator certificates (a certificate, its key and the cluster CA)")]
    NoCredentials,
}

/// The operator's mTLS material: this node's chain and key, and the CA both sides verify with.
pub struct OperatorCerts {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Arc<rustls::RootCertStore>,
}

impl OperatorCerts {
    /// This node's chain (leaf first) and key, to present.
    pub(crate) fn identity(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (self.chain.clone(), self.key.clone_key())
    }

    /// The CA peers' chains must verify against.
    pub(crate) fn roots(&self) -> Arc<rustls::RootCertStore> {
        self.roots.clone()
    }

    /// Reads PEM files: the certificate chain (leaf first), its private key, and the CA
    /// certificate(s).
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TransportError> {
        let bad = |p: &Path, reason: String| TransportError::Certificate { path: p.display().to_string(), reason };
        let read = |p: &Path| -> Result<Vec<u8>, TransportError> {
            let meta = std::fs::metadata(p).map_err(|e| bad(p, e.to_string()))?;
            if meta.len() > 1 << 20 {
                return Err(bad(p, format!("{} bytes is not a PEM certificate or key (limit 1 MiB)", meta.len())));
            }
            std::fs::read(p).map_err(|e| bad(p, e.to_string()))
        };
        let pem_certs = |p: &Path| -> Result<Vec<CertificateDer<'static>>, TransportError> {
            let certs = CertificateDer::pem_slice_iter(&read(p)?).collect::<Result<Vec<_>, _>>().map_err(|e| bad(p, format!("not PEM certificates: {e}")))?;
            if certs.is_empty() {
                return Err(bad(p, "no CERTIFICATE block".into()));
            }
            Ok(certs)
        };
        let chain = pem_certs(cert)?;
        let key_der = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| bad(key, format!("no private key: {e}")))?;
        let mut roots = rustls::RootCertStore::empty();
        for c in pem_certs(ca)? {
            roots.add(c).map_err(|e| bad(ca, format!("not a usable CA certificate: {e}")))?;
        }
        Ok(OperatorCerts { chain, key: key_der, roots: Arc::new(roots) })
    }
}

/// How this node proves itself and checks its peers: a join token, operator certificates, or both.
#[derive(Clone)]
pub struct Credentials {
    pub token: Option<JoinToken>,
    pub certs: Option<Arc<OperatorCerts>>,
}

impl Credentials {
    pub fn new(token: Option<JoinToken>, certs: Option<OperatorCerts>) -> Result<Self, TransportError> {
        if token.is_none() && certs.is_none() {
            return Err(TransportError::NoCredentials);
        }
        Ok(Credentials { token, certs: certs.map(Arc::new) })
    }

    pub fn token(token: JoinToken) -> Self {
        Credentials { token: Some(token), certs: None }
    }
}

/// The cluster's shared secret: a plain secret or a `SHM1<ca-sha256>::<secret>` token (the same
/// secret either way; the CA pin matters to the control plane).
#[derive(Clone)]
pub struct JoinToken(Arc<ring::hmac::Key>, shimmer_control::ClusterToken);

impl JoinToken {
    pub fn new(token: &str) -> Result<Self, TransportError> {
        let parsed = shimmer_control::ClusterToken::parse(token).map_err(TransportError::WeakToken)?;
        Ok(JoinToken(Arc::new(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, parsed.secret().as_bytes())), parsed))
    }

    /// The token as parsed (its secret and CA pin).
    pub fn cluster_token(&self) -> &shimmer_control::ClusterToken {
        &self.1
    }

    fn proof(&self, conn: &quinn::Connection, role: &[u8]) -> Result<[u8; PROOF_LEN], String> {
        let mut secret = [0u8; 32];
        conn.export_keying_material(&mut secret, EXPORTER_LABEL, role).map_err(|e| format!("no TLS exporter: {e:?}"))?;
        let tag = ring::hmac::sign(&self.0, &secret);
        let mut out = [0u8; PROOF_LEN];
        out.copy_from_slice(tag.as_ref());
        Ok(out)
    }

    fn check(&self, conn: &quinn::Connection, role: &[u8], proof: &[u8]) -> bool {
        let mut secret = [0u8; 32];
        if conn.export_keying_material(&mut secret, EXPORTER_LABEL, role).is_err() {
            return false;
        }
        ring::hmac::verify(&self.0, &secret, proof).is_ok()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn transport_config() -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.keep_alive_interval(Some(Duration::from_secs(2)));
    if let Ok(idle) = quinn::IdleTimeout::try_from(Duration::from_secs(10)) {
        t.max_idle_timeout(Some(idle));
    }
    Arc::new(t)
}

/// A listening endpoint: with operator certificates, presenting them and requiring a client
/// certificate from the same CA; otherwise with a fresh self-signed identity.
pub fn server(addr: SocketAddr, creds: &Credentials) -> Result<quinn::Endpoint, TransportError> {
    let tls = |e: &dyn std::fmt::Display| TransportError::Tls(e.to_string());
    let builder = rustls::ServerConfig::builder_with_provider(provider()).with_protocol_versions(&[&rustls::version::TLS13]).map_err(|e| tls(&e))?;
    let mut cfg = match &creds.certs {
        Some(op) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(op.roots.clone(), provider()).build().map_err(|e| tls(&e))?;
            builder.with_client_cert_verifier(verifier).with_single_cert(op.chain.clone(), op.key.clone_key()).map_err(|e| tls(&e))?
        }
        None => {
            let cert = rcgen::generate_simple_self_signed(vec!["shimmer".to_string()]).map_err(|e| tls(&e))?;
            let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der()));
            builder.with_no_client_auth().with_single_cert(vec![cert.cert.der().clone()], key).map_err(|e| tls(&e))?
        }
    };
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(cfg).map_err(|e| tls(&e))?));
    server.transport_config(transport_config());
    quinn::Endpoint::server(server, addr).map_err(|source| TransportError::Bind { addr, source })
}

/// An endpoint that connects out (any local port): with operator certificates, verifying the
/// server's against the CA and presenting its own; otherwise trusting the join-token proof.
pub fn client(creds: &Credentials) -> Result<quinn::Endpoint, TransportError> {
    let tls = |e: &dyn std::fmt::Display| TransportError::Tls(e.to_string());
    let provider = provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone()).with_protocol_versions(&[&rustls::version::TLS13]).map_err(|e| tls(&e))?;
    let mut cfg = match &creds.certs {
        Some(op) => builder.with_root_certificates(op.roots.clone()).with_client_auth_cert(op.chain.clone(), op.key.clone_key()).map_err(|e| tls(&e))?,
        None => builder.dangerous().with_custom_certificate_verifier(Arc::new(TokenBound(provider))).with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    let mut client = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(cfg).map_err(|e| tls(&e))?));
    client.transport_config(transport_config());
    let bind: SocketAddr = ([0, 0, 0, 0], 0).into();
    let mut ep = quinn::Endpoint::client(bind).map_err(|source| TransportError::Bind { addr: bind, source })?;
    ep.set_default_client_config(client);
    Ok(ep)
}

/// Accepts any certificate whose handshake signature verifies: identity comes from the join-token
/// proof over the session's exporter secret, not from a CA.
#[derive(Debug)]
pub(crate) struct TokenBound(pub(crate) Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for TokenBound {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Why a connection ended, in words: TLS alerts (QUIC crypto errors) named, the rest as quinn says.
pub fn describe_close(e: &quinn::ConnectionError) -> String {
    match e {
        quinn::ConnectionError::ConnectionClosed(c) if tls_alert(c.error_code) => {
            format!("the peer refused our TLS credentials: {}", String::from_utf8_lossy(&c.reason))
        }
        quinn::ConnectionError::TransportError(t) if tls_alert(t.code) => format!("we refused the peer's TLS credentials: {}", t.reason),
        other => other.to_string(),
    }
}

/// QUIC carries a TLS alert as a transport error code 0x100 + alert.
fn tls_alert(code: quinn::TransportErrorCode) -> bool {
    (0x100..0x200).contains(&u64::from(code))
}

/// Connects to a node and checks its credentials both ways; the connection is then ready for work.
pub async fn connect(ep: &quinn::Endpoint, addr: SocketAddr, creds: &Credentials) -> Result<quinn::Connection, TransportError> {
    let fail = |reason: String| TransportError::Connect { addr, reason };
    // Operator certificates name a worker by the IP address it is dialled at.
    let server_name = if creds.certs.is_some() { addr.ip().to_string() } else { "shimmer".to_string() };
    let conn = ep.connect(addr, &server_name).map_err(|e| fail(e.to_string()))?.await.map_err(|e| match &e {
        quinn::ConnectionError::ConnectionClosed(c) if tls_alert(c.error_code) => TransportError::Handshake { peer: addr, reason: describe_close(&e) },
        quinn::ConnectionError::TransportError(t) if tls_alert(t.code) => TransportError::Handshake { peer: addr, reason: describe_close(&e) },
        _ => fail(e.to_string()),
    })?;
    let Some(token) = &creds.token else { return Ok(conn) };
    let hs = |reason: String| TransportError::Handshake { peer: addr, reason };
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| hs(e.to_string()))?;
    send.write_all(&token.proof(&conn, b"client").map_err(hs)?).await.map_err(|e| hs(e.to_string()))?;
    send.finish().map_err(|e| hs(e.to_string()))?;
    let theirs = match recv.read_to_end(PROOF_LEN).await {
        Ok(p) => p,
        // The server closes the connection when our proof fails.
        Err(_) => return Err(TransportError::Refused),
    };
    if !token.check(&conn, b"server", &theirs) {
        conn.close(CLOSE_AUTH_FAILED.into(), b"join token");
        return Err(TransportError::Refused);
    }
    Ok(conn)
}

/// Accepts a connection's proof stream and answers with ours; closes the connection when the
/// client's proof fails. (Operator certificates were checked by the handshake already.)
pub async fn authenticate(conn: &quinn::Connection, creds: &Credentials) -> Result<(), TransportError> {
    let Some(token) = &creds.token else { return Ok(()) };
    let peer = conn.remote_address();
    let hs = |reason: String| TransportError::Handshake { peer, reason };
    let accepted = tokio::time::timeout(Duration::from_secs(10), conn.accept_bi()).await.map_err(|_| hs("no proof within 10 s".into()))?;
    let (mut send, mut recv) = accepted.map_err(|e| hs(e.to_string()))?;
    let theirs = recv.read_to_end(PROOF_LEN).await.map_err(|e| hs(e.to_string()))?;
    if !token.check(conn, b"client", &theirs) {
        conn.close(CLOSE_AUTH_FAILED.into(), b"join token");
        return Err(TransportError::Refused);
    }
    send.write_all(&token.proof(conn, b"server").map_err(hs)?).await.map_err(|e| hs(e.to_string()))?;
    send.finish().map_err(|e| hs(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pair(server_token: &str, client_token: &str) -> (Result<(), TransportError>, Result<quinn::Connection, TransportError>) {
        let srv = server(([127, 0, 0, 1], 0).into(), &Credentials::token(JoinToken::new(server_token).unwrap())).unwrap();
        let addr = srv.local_addr().unwrap();
        let st = Credentials::token(JoinToken::new(server_token).unwrap());
        let accept = tokio::spawn(async move {
            let conn = srv.accept().await.unwrap().await.unwrap();
            let r = authenticate(&conn, &st).await;
            // Keep the connection up long enough for the client to read our answer.
            tokio::time::sleep(Duration::from_millis(200)).await;
            (r, srv)
        });
        let ct = Credentials::token(JoinToken::new(client_token).unwrap());
        let cli = client(&ct).unwrap();
        let c = connect(&cli, addr, &ct).await;
        let (s, _srv) = accept.await.unwrap();
        (s, c)
    }

    #[tokio::test]
    async fn nodes_with_the_same_token_connect_and_others_are_refused() {
        let (s, c) = pair("the-cluster-secret-1", "the-cluster-secret-1").await;
        assert!(s.is_ok() && c.is_ok(), "{s:?} {:?}", c.err());
        let c = c.unwrap();
        assert_eq!(c.handshake_data().and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok()).and_then(|d| d.protocol), Some(ALPN.to_vec()));
        let (s, c) = pair("the-cluster-secret-1", "a-different-secret-2").await;
        assert!(matches!(s, Err(TransportError::Refused)), "{s:?}");
        assert!(matches!(c, Err(TransportError::Refused)), "{:?}", c.err());
        assert!(matches!(JoinToken::new("short"), Err(TransportError::WeakToken(_))));
        // The SHM1 form proves the same secret as the plain one.
        let pinned = shimmer_control::ClusterToken::pinned("the-cluster-secret-1", b"ca").unwrap().to_token_string();
        let (s, c) = pair("the-cluster-secret-1", &pinned).await;
        assert!(s.is_ok() && c.is_ok(), "{s:?} {:?}", c.err());
    }

    /// The reverse direction: a "worker" that accepts anyone and answers with a proof it cannot
    /// compute (it lacks the token) is refused by the coordinator.
    #[tokio::test]
    async fn a_coordinator_refuses_a_worker_that_cannot_prove_the_token() {
        let creds = Credentials::token(JoinToken::new("the-cluster-secret-1").unwrap());
        let srv = server(([127, 0, 0, 1], 0).into(), &creds).unwrap();
        let addr = srv.local_addr().unwrap();
        let impostor = tokio::spawn(async move {
            let conn = srv.accept().await.unwrap().await.unwrap();
            let (mut send, mut recv) = conn.accept_bi().await.unwrap();
            let _ = recv.read_to_end(PROOF_LEN).await;
            send.write_all(&[0x5a; PROOF_LEN]).await.unwrap();
            send.finish().unwrap();
            conn.closed().await
        });
        let cli = client(&creds).unwrap();
        let c = connect(&cli, addr, &creds).await;
        assert!(matches!(c, Err(TransportError::Refused)), "{:?}", c.err());
        // The coordinator closed the connection with the authentication code.
        let closed = impostor.await.unwrap();
        assert!(matches!(closed, quinn::ConnectionError::ApplicationClosed(ref a) if a.error_code == CLOSE_AUTH_FAILED.into()), "{closed:?}");
    }
}
