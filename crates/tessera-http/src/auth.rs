//! Bearer tokens of the management API on TCP: a token file holds one token a line, each
//! optionally named (`NAME:TOKEN`) so that the audit log can say who called without ever
//! printing the token.

use std::fmt;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use axum::http::HeaderMap;

/// Shortest token accepted: 128 bits as hex (`openssl rand -hex 32` gives 64 characters).
pub const MIN_TOKEN_LEN: usize = 32;

/// The tokens that open the API, each with the identity the audit log names.
pub struct TokenSet {
    tokens: Vec<(String, Vec<u8>)>,
}

impl fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Identities only: a token must not reach a log through a Debug print.
        let names: Vec<&str> = self.tokens.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("TokenSet")
            .field("identities", &names)
            .finish()
    }
}

/// Characters of an RFC 6750 `b64token`; `:` is not one, which keeps `NAME:TOKEN` plain.
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~+/=".contains(&b)
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._@".contains(&b)
}

/// Why a token file is refused; a line's error names the line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenFileError {
    #[error("line {line}: the token's name {name:?} may hold only letters, digits and -._@")]
    BadName { line: usize, name: String },
    #[error("line {line}: a token has at least {MIN_TOKEN_LEN} characters (make one with `openssl rand -hex 32`)")]
    TooShort { line: usize },
    #[error("line {line}: a token may hold only letters, digits and -._~+/=")]
    BadToken { line: usize },
    #[error("it holds no token")]
    NoToken,
    #[error("other users may read it; `chmod 600` it (or 640 with a group)")]
    OthersMayRead,
}

/// A [`TokenFileError`] of the file at `path` (inside the `io::Error` that
/// [`TokenSet::load`] returns).
#[derive(Debug, thiserror::Error)]
#[error("token file {}: {source}", path.display())]
pub struct TokenFileAt {
    pub path: std::path::PathBuf,
    #[source]
    pub source: TokenFileError,
}

/// Splits a token-file line into `(identity, token)`; `line_no` names an unnamed token.
fn parse_line(line: &str, line_no: usize) -> Result<(String, &str), TokenFileError> {
    let (name, token) = match line.split_once(':') {
        Some((name, token)) => {
            if name.is_empty() || !name.bytes().all(is_name_char) {
                return Err(TokenFileError::BadName {
                    line: line_no,
                    name: name.to_string(),
                });
            }
            (name.to_string(), token.trim())
        }
        None => (format!("token-line-{line_no}"), line),
    };
    if token.len() < MIN_TOKEN_LEN {
        return Err(TokenFileError::TooShort { line: line_no });
    }
    if !token.bytes().all(is_token_char) {
        return Err(TokenFileError::BadToken { line: line_no });
    }
    Ok((name, token))
}

/// The first token of a token file's text, without its `NAME:` (what a client sends).
pub fn first_token(text: &str) -> Option<&str> {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.split_once(':').map_or(l, |(_, t)| t.trim()))
}

impl TokenSet {
    /// Parses a token file's text: one token a line, `NAME:TOKEN` or `TOKEN`; blank lines
    /// and lines starting with `#` are skipped.
    pub fn parse(text: &str) -> Result<TokenSet, TokenFileError> {
        let mut tokens = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, token) = parse_line(line, i + 1)?;
            tokens.push((name, token.as_bytes().to_vec()));
        }
        if tokens.is_empty() {
            return Err(TokenFileError::NoToken);
        }
        Ok(TokenSet { tokens })
    }

    /// Reads a token file, which only its owner (and group) may read.
    pub fn load(path: &Path) -> io::Result<TokenSet> {
        let invalid = |source: TokenFileError| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                TokenFileAt {
                    path: path.to_path_buf(),
                    source,
                },
            )
        };
        let meta = std::fs::metadata(path)
            .map_err(|e| io::Error::new(e.kind(), format!("token file {}: {e}", path.display())))?;
        if meta.permissions().mode() & 0o007 != 0 {
            return Err(invalid(TokenFileError::OthersMayRead));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| io::Error::new(e.kind(), format!("token file {}: {e}", path.display())))?;
        TokenSet::parse(&text).map_err(invalid)
    }

    /// The identity of the token a request presents in `Authorization: Bearer`, compared
    /// in constant time against every token (no early exit on the first match), or why the
    /// request is refused.
    pub fn identify(&self, headers: &HeaderMap) -> Result<&str, AuthFailure> {
        let value = headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or(AuthFailure::Missing)?;
        let presented = value
            .to_str()
            .ok()
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .ok_or(AuthFailure::Malformed)?;
        let mut found = None;
        for (name, token) in &self.tokens {
            if constant_time_eq(presented.as_bytes(), token) && found.is_none() {
                found = Some(name.as_str());
            }
        }
        found.ok_or(AuthFailure::Wrong)
    }
}

/// Why a request was not let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    Missing,
    Malformed,
    Wrong,
}

impl AuthFailure {
    pub fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => {
                "authentication required: send `Authorization: Bearer TOKEN` (tessera --token-file)"
            }
            AuthFailure::Malformed => "the Authorization header is not `Bearer TOKEN`",
            AuthFailure::Wrong => "the bearer token is not valid",
        }
    }
}

/// Equality whose time depends on the lengths only, not on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const T1: &str = "0123456789abcdef0123456789abcdef";
    const T2: &str = "fedcba9876543210fedcba9876543210";

    fn bearer(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(axum::http::header::AUTHORIZATION, v.parse().unwrap());
        h
    }

    #[test]
    fn named_and_unnamed_tokens_identify_their_caller() {
        let set = TokenSet::parse(&format!("# ops\nalice:{T1}\n\n{T2}\n")).unwrap();
        assert_eq!(set.identify(&bearer(&format!("Bearer {T1}"))), Ok("alice"));
        assert_eq!(
            set.identify(&bearer(&format!("bearer {T2}"))),
            Ok("token-line-4")
        );
        assert_eq!(
            set.identify(&bearer(&format!("Bearer {T1}x"))),
            Err(AuthFailure::Wrong)
        );
        assert_eq!(
            set.identify(&bearer(&format!("Basic {T1}"))),
            Err(AuthFailure::Malformed)
        );
        assert_eq!(set.identify(&HeaderMap::new()), Err(AuthFailure::Missing));
        assert!(!format!("{set:?}").contains(T1), "Debug shows no token");
    }

    #[test]
    fn weak_or_malformed_token_files_are_refused() {
        assert!(TokenSet::parse("# nothing\n\n").is_err());
        assert!(TokenSet::parse("short")
            .unwrap_err()
            .to_string()
            .contains("at least"));
        assert!(TokenSet::parse(&format!("bad name:{T1}")).is_err());
        assert!(TokenSet::parse(&format!("{T1} {T2}")).is_err());
        assert_eq!(first_token(&format!("# c\nalice:{T1}\n")), Some(T1));
        assert_eq!(first_token(&format!("{T2}\n")), Some(T2));
    }

    #[test]
    fn a_token_file_others_can_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, format!("{T1}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = TokenSet::load(&path).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        TokenSet::load(&path).unwrap();
    }
}
