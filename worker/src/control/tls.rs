//! The control plane's trust: TCP + TLS 1.3 (rustls), then the join token proven both ways over
//! the session's exporter secret before a byte of gRPC flows — the data plane's proof
//! (`transport.rs`), on TCP. Every member serves a certificate signed by the cluster CA (made at
//! bootstrap, handed to members when they join); a joining node given a `SHM1…` token checks that
//! the server's chain holds the CA the token pins, so it authenticates the cluster before it
//! says anything. With a plain secret the proof alone authenticates both sides (k3s without the
//! CA hash). With operator certificates (`--tls-cert/--tls-key/--tls-ca`) both sides present
//! chains that must verify against the operator's CA — the server's for the host dialled — and
//! the handshake refuses strangers; given a token too, the proofs are exchanged as well.
//!
//! Must never: hand a connection to gRPC before both proofs checked out (with a token) or the
//! peer's chain verified (with operator certificates); compare proofs in variable time; accept a
//! chain without the pinned CA when the token pins one.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use shimmer_control::token::{sha256, ClusterToken};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

const ALPN: &[u8] = b"shimmer-control/1";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-shimmer-control/1 join";
const PROOF_LEN: usize = 32;
/// What a server trusting operator certificates alone sends once the client's chain verified.
const ACCEPTED: u8 = 0x01;
/// The name in every member's certificate (members are told apart by the proof, not by name).
const SERVER_NAME: &str = "shimmer";
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const CA_CERT_FILE: &str = "cluster-ca.pem";
const CA_KEY_FILE: &str = "cluster-ca.key";
const WRONG_CA: &str = "the control plane's CA is not the one the join token pins (another cluster?)";

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("TLS setup: {0}")]
    Tls(String),
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
    #[error("{addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("{addr} refused this node or did not prove the cluster's join token (a wrong token, operator certificates missing or from another CA, or not a shimmer control plane)")]
    Refused { addr: String },
    #[error("{addr}: {WRONG_CA}")]
    WrongCa { addr: String },
}

/// The cluster CA: its certificate (whose SHA-256 a `SHM1` token pins) and key.
#[derive(Clone)]
pub struct ClusterCa {
    pub cert_der: Vec<u8>,
    pub key_pem: String,
}

fn ca_params() -> Result<rcgen::CertificateParams, TrustError> {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(|e| TrustError::Tls(e.to_string()))?;
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.distinguished_name.push(rcgen::DnType::CommonName, "shimmer cluster CA");
    params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
    Ok(params)
}

impl ClusterCa {
    pub fn generate() -> Result<ClusterCa, TrustError> {
        let key = rcgen::KeyPair::generate().map_err(|e| TrustError::Tls(e.to_string()))?;
        let cert = ca_params()?.self_signed(&key).map_err(|e| TrustError::Tls(e.to_string()))?;
        Ok(ClusterCa { cert_der: cert.der().to_vec(), key_pem: key.serialize_pem() })
    }

    pub fn sha256(&self) -> [u8; 32] {
        sha256(&self.cert_der)
    }

    /// Reads the CA a node keeps in its data directory, if it has one.
    pub fn load(dir: &Path) -> Result<Option<ClusterCa>, TrustError> {
        let (cert_path, key_path) = (dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE));
        if !cert_path.exists() {
            return Ok(None);
        }
        let bad = |p: &Path, reason: String| TrustError::File { path: p.display().to_string(), reason };
        let read = |p: &Path| -> Result<String, TrustError> {
            let meta = std::fs::metadata(p).map_err(|e| bad(p, e.to_string()))?;
            if meta.len() > 64 << 10 {
                return Err(bad(p, format!("{} bytes is not a CA certificate or key", meta.len())));
            }
            std::fs::read_to_string(p).map_err(|e| bad(p, e.to_string()))
        };
        use rustls::pki_types::pem::PemObject;
        let cert = CertificateDer::from_pem_slice(read(&cert_path)?.as_bytes()).map_err(|e| bad(&cert_path, format!("not a PEM certificate: {e}")))?;
        let key_pem = read(&key_path)?;
        rcgen::KeyPair::from_pem(&key_pem).map_err(|e| bad(&key_path, format!("not a PEM private key: {e}")))?;
        Ok(Some(ClusterCa { cert_der: cert.to_vec(), key_pem }))
    }

    /// Writes the CA into the data directory (the key readable by its owner only).
    pub fn save(&self, dir: &Path) -> Result<(), TrustError> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let write = |name: &str, bytes: &[u8], mode: u32| -> Result<(), TrustError> {
            let path = dir.join(name);
            let bad = |e: std::io::Error| TrustError::File { path: path.display().to_string(), reason: e.to_string() };
            let tmp = dir.join(format!("{name}.tmp"));
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp).map_err(bad)?;
            f.write_all(bytes).and_then(|_| f.sync_all()).map_err(bad)?;
            std::fs::rename(&tmp, &path).map_err(bad)
        };
        let cert_pem = pem_encode("CERTIFICATE", &self.cert_der);
        write(CA_KEY_FILE, self.key_pem.as_bytes(), 0o600)?;
        write(CA_CERT_FILE, cert_pem.as_bytes(), 0o644)
    }

    /// A fresh serving identity signed by the CA: the chain (leaf, CA) and the leaf's key.
    fn leaf(&self) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TrustError> {
        let tls = |e: rcgen::Error| TrustError::Tls(e.to_string());
        let ca_key = rcgen::KeyPair::from_pem(&self.key_pem).map_err(tls)?;
        // The issuer's name and key are what a child names; re-signing the same parameters
        // gives an issuer every child of the stored certificate verifies against.
        let issuer = ca_params()?.self_signed(&ca_key).map_err(tls)?;
        let key = rcgen::KeyPair::generate().map_err(tls)?;
        let params = rcgen::CertificateParams::new(vec![SERVER_NAME.to_string()]).map_err(tls)?;
        let leaf = params.signed_by(&key, &issuer, &ca_key).map_err(tls)?;
        let chain = vec![leaf.der().clone(), CertificateDer::from(self.cert_der.clone())];
        Ok((chain, PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()))))
    }
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::new();
    for chunk in der.chunks(3) {
        let n = (u32::from(chunk[0]) << 16) | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8) | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// How this node proves itself and checks peers on the control plane: the join token (proven
/// over the session), operator certificates (mutual TLS against the operator's CA), or both —
/// then a connection must pass both, as on the data plane.
#[derive(Clone)]
pub struct ControlTrust {
    token: Option<(ClusterToken, Arc<ring::hmac::Key>)>,
    certs: Option<Arc<crate::transport::OperatorCerts>>,
}

impl ControlTrust {
    pub fn new(token: Option<ClusterToken>, certs: Option<Arc<crate::transport::OperatorCerts>>) -> Result<ControlTrust, TrustError> {
        if token.is_none() && certs.is_none() {
            return Err(TrustError::Tls("the control plane needs the cluster's join token or operator certificates (--tls-cert, --tls-key, --tls-ca)".into()));
        }
        if certs.is_some() && token.as_ref().is_some_and(|t| t.ca_sha256().is_some()) {
            return Err(TrustError::Tls(
                "a SHM1 join token pins the cluster CA, which operator certificates replace on the control plane: give its plain secret (the part after `::`) or no token".into(),
            ));
        }
        Ok(ControlTrust { token: token.map(Self::keyed), certs })
    }

    /// Trust by the join token alone.
    pub fn with_token(token: ClusterToken) -> ControlTrust {
        ControlTrust { token: Some(Self::keyed(token)), certs: None }
    }

    fn keyed(token: ClusterToken) -> (ClusterToken, Arc<ring::hmac::Key>) {
        let key = Arc::new(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token.secret().as_bytes()));
        (token, key)
    }

    pub fn token(&self) -> Option<&ClusterToken> {
        self.token.as_ref().map(|(t, _)| t)
    }

    fn proof(key: &ring::hmac::Key, exporter: &[u8; 32]) -> [u8; PROOF_LEN] {
        let mut out = [0u8; PROOF_LEN];
        out.copy_from_slice(ring::hmac::sign(key, exporter).as_ref());
        out
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server-side TLS acceptor: with operator certificates, presenting them and requiring a
/// client chain from the operator's CA; otherwise presenting a fresh cluster-CA-signed identity.
pub fn acceptor(ca: &ClusterCa, trust: &ControlTrust) -> Result<tokio_rustls::TlsAcceptor, TrustError> {
    let tls = |e: &dyn std::fmt::Display| TrustError::Tls(e.to_string());
    let builder = rustls::ServerConfig::builder_with_provider(provider()).with_protocol_versions(&[&rustls::version::TLS13]).map_err(|e| tls(&e))?;
    let mut cfg = match &trust.certs {
        Some(op) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(op.roots(), provider()).build().map_err(|e| tls(&e))?;
            let (chain, key) = op.identity();
            builder.with_client_cert_verifier(verifier).with_single_cert(chain, key).map_err(|e| tls(&e))?
        }
        None => {
            let (chain, key) = ca.leaf()?;
            builder.with_no_client_auth().with_single_cert(chain, key).map_err(|e| tls(&e))?
        }
    };
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(cfg)))
}

/// A connection whose peer proved the token: what gRPC runs over.
pub struct Authed<S>(pub S);

impl<S: AsyncRead + Unpin> AsyncRead for Authed<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Authed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Authed<tokio_rustls::server::TlsStream<TcpStream>> {
    type ConnectInfo = Option<SocketAddr>;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.0.get_ref().0.peer_addr().ok()
    }
}

/// Accepts one connection: TLS, then the client's proof, then ours.
pub async fn accept(
    tcp: TcpStream,
    acceptor: &tokio_rustls::TlsAcceptor,
    trust: &ControlTrust,
) -> Result<Authed<tokio_rustls::server::TlsStream<TcpStream>>, String> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let mut tls = acceptor.accept(tcp).await.map_err(|e| format!("TLS: {e}"))?;
        // Operator certificates alone: the handshake verified the client's chain; one byte says
        // so, so that a client whose chain was refused learns it at once, not from gRPC.
        let Some((_, key)) = &trust.token else {
            tls.write_all(&[ACCEPTED]).await.map_err(|e| e.to_string())?;
            tls.flush().await.map_err(|e| e.to_string())?;
            return Ok(Authed(tls));
        };
        let mut secret = [0u8; 32];
        tls.get_ref().1.export_keying_material(&mut secret, EXPORTER_LABEL, Some(b"client")).map_err(|e| e.to_string())?;
        let mut theirs = [0u8; PROOF_LEN];
        tls.read_exact(&mut theirs).await.map_err(|e| format!("no proof: {e}"))?;
        if ring::hmac::verify(key, &secret, &theirs).is_err() {
            return Err("the peer did not prove the join token".to_string());
        }
        let mut ours = [0u8; 32];
        tls.get_ref().1.export_keying_material(&mut ours, EXPORTER_LABEL, Some(b"server")).map_err(|e| e.to_string())?;
        tls.write_all(&ControlTrust::proof(key, &ours)).await.map_err(|e| e.to_string())?;
        tls.flush().await.map_err(|e| e.to_string())?;
        Ok(Authed(tls))
    })
    .await
    .map_err(|_| "no proof within 10 s".to_string())?
}

/// Dials a member (HOST:PORT; hostnames resolve), checks the server's chain (against the
/// operator's CA, or for the CA the token pins if it pins one), and exchanges proofs (with a
/// token).
pub async fn dial(addr: &str, trust: &ControlTrust) -> Result<Authed<tokio_rustls::client::TlsStream<TcpStream>>, TrustError> {
    let fail = |reason: String| TrustError::Connect { addr: addr.to_string(), reason };
    let tls_cfg = |e: &dyn std::fmt::Display| TrustError::Tls(e.to_string());
    let builder = rustls::ClientConfig::builder_with_provider(provider()).with_protocol_versions(&[&rustls::version::TLS13]).map_err(|e| tls_cfg(&e))?;
    let (mut cfg, name) = match &trust.certs {
        // Operator certificates: the server's chain verifies against the operator's CA for the
        // host dialled, and this node presents its own.
        Some(op) => {
            let (chain, key) = op.identity();
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
            let name = ServerName::try_from(host.to_string()).map_err(|e| fail(format!("`{host}` is not a name a certificate can hold: {e}")))?;
            (builder.with_root_certificates(op.roots()).with_client_auth_cert(chain, key).map_err(|e| tls_cfg(&e))?, name)
        }
        None => {
            let verifier: Arc<dyn rustls::client::danger::ServerCertVerifier> = match trust.token().and_then(|t| t.ca_sha256()) {
                Some(pin) => Arc::new(PinnedCa { pin, provider: provider(), signatures: crate::transport::TokenBound(provider()) }),
                None => Arc::new(crate::transport::TokenBound(provider())),
            };
            let name = ServerName::try_from(SERVER_NAME).map_err(|e| tls_cfg(&e))?;
            (builder.dangerous().with_custom_certificate_verifier(verifier).with_no_client_auth(), name)
        }
    };
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| fail(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let mut tls = connector.connect(name, tcp).await.map_err(|e| {
            let ours = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()).is_some_and(|r| matches!(r, rustls::Error::General(m) if m == WRONG_CA));
            if ours {
                TrustError::WrongCa { addr: addr.to_string() }
            } else {
                fail(format!("TLS: {e}"))
            }
        })?;
        let Some((_, key)) = &trust.token else {
            let mut byte = [0u8; 1];
            return match tls.read_exact(&mut byte).await {
                Ok(_) if byte[0] == ACCEPTED => Ok(Authed(tls)),
                _ => Err(TrustError::Refused { addr: addr.to_string() }),
            };
        };
        let mut secret = [0u8; 32];
        tls.get_ref().1.export_keying_material(&mut secret, EXPORTER_LABEL, Some(b"client")).map_err(|e| fail(e.to_string()))?;
        tls.write_all(&ControlTrust::proof(key, &secret)).await.map_err(|e| fail(e.to_string()))?;
        tls.flush().await.map_err(|e| fail(e.to_string()))?;
        let mut theirs = [0u8; PROOF_LEN];
        // A server that refuses our proof closes the connection.
        if tls.read_exact(&mut theirs).await.is_err() {
            return Err(TrustError::Refused { addr: addr.to_string() });
        }
        let mut want = [0u8; 32];
        tls.get_ref().1.export_keying_material(&mut want, EXPORTER_LABEL, Some(b"server")).map_err(|e| fail(e.to_string()))?;
        if ring::hmac::verify(key, &want, &theirs).is_err() {
            return Err(TrustError::Refused { addr: addr.to_string() });
        }
        Ok(Authed(tls))
    })
    .await
    .map_err(|_| fail("no answer within 10 s".into()))?
}

/// Accepts a server chain only if it holds the CA the token pins and the leaf verifies under it.
#[derive(Debug)]
struct PinnedCa {
    pin: [u8; 32],
    provider: Arc<rustls::crypto::CryptoProvider>,
    signatures: crate::transport::TokenBound,
}

impl rustls::client::danger::ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let ca = intermediates.iter().find(|c| sha256(c) == self.pin).ok_or_else(|| rustls::Error::General(WRONG_CA.into()))?;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone().into_owned()).map_err(|e| rustls::Error::General(e.to_string()))?;
        let v = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        let name = ServerName::try_from(SERVER_NAME).map_err(|e| rustls::Error::General(e.to_string()))?;
        v.verify_server_cert(end_entity, &[], &name, ocsp, now)
    }
    // Handshake signatures are checked as for any token-bound peer.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.signatures.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.signatures.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.signatures.supported_verify_schemes()
    }
}

/// A random identifier (a new cluster's id): 16 bytes from the system's generator, in hex.
pub fn random_id() -> String {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 16];
    // The system generator does not fail on Linux; a zero id would still be a valid name.
    let _ = ring::rand::SystemRandom::new().fill(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}
