//! URLs as they may be shown: the one place a URL is made showable. Every URL that reaches a log
//! line, an error, a metric, a span or a report to the engine goes through here:
//!
//! - [`url`] drops the parts that carry secrets (userinfo, query, fragment) from one URL;
//! - [`origin`] keeps only scheme, host and port (where the path says nothing the reader needs);
//! - [`text`] shows every URL inside a free text (a library's error message) as [`url`] does;
//! - [`text_without_urls`] takes every URL out of a text: a tool server's errors name the server
//!   by its registry name, never by a URL, whose path may be a secret too (a key in a path);
//! - [`error_text`] is an error and its sources on one line ([`crate::errors::chain`]) with every
//!   URL in it shown as [`url`] shows it: reqwest, hyper and rmcp write whole URLs, query
//!   included, into their messages.
//!
//! A URL inside a text is found by its `scheme://` and runs to the first white space, quote or
//! angle bracket; closing brackets and punctuation it does not open are given back to the text
//! (`(http://h/x?k=v)` keeps its parentheses). Userinfo may hold any of those characters, so a
//! text cut inside an authority is cut as an authority (everything up to the last `@` dropped).

use std::error::Error;

/// `raw` without userinfo, query and fragment: `https://user:pw@host/p?key=v#f` shows as
/// `https://host/p`. Text that does not parse as a URL is cut the same way by hand (at `?`/`#`,
/// and anything before an `@` in the authority dropped), so a malformed URL cannot leak either.
pub fn url(raw: &str) -> String {
    if let Ok(mut parsed) = reqwest::Url::parse(raw)
        && parsed.has_host()
    {
        // Nothing to drop: shown as written (an issuer URL's trailing slash, or its absence,
        // is what an operator compares).
        if parsed.username().is_empty()
            && parsed.password().is_none()
            && parsed.query().is_none()
            && parsed.fragment().is_none()
        {
            return raw.to_string();
        }
        let _ = parsed.set_username("");
        let _ = parsed.set_password(None);
        parsed.set_query(None);
        parsed.set_fragment(None);
        return parsed.to_string();
    }
    let (scheme, authority, path) = split_by_hand(raw);
    format!("{scheme}{authority}{path}")
}

/// `raw`'s scheme, host and port only: `https://user:pw@host:8443/key/p?k=v` shows as
/// `https://host:8443`. For messages where the destination matters and the path does not (a
/// credential that would travel in clear to that host).
pub(crate) fn origin(raw: &str) -> String {
    if let Ok(parsed) = reqwest::Url::parse(raw)
        && let Some(host) = parsed.host_str()
    {
        return match parsed.port() {
            Some(port) => format!("{}://{host}:{port}", parsed.scheme()),
            None => format!("{}://{host}", parsed.scheme()),
        };
    }
    let (scheme, authority, _) = split_by_hand(raw);
    format!("{scheme}{authority}")
}

/// A URL that did not parse, cut by hand: the scheme with its `//`, the host (and port) after
/// the last `@` (a password may hold any character, a `/` included), and the path without query
/// or fragment.
fn split_by_hand(raw: &str) -> (&str, &str, &str) {
    let (scheme, rest) = match raw.find("//") {
        Some(i) => (&raw[..i + 2], &raw[i + 2..]),
        None => ("", raw),
    };
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let path = tail.find(['?', '#']).map_or(tail, |i| &tail[..i]);
    (scheme, authority, path)
}

/// `text` with every URL in it shown as [`url`] shows it.
pub(crate) fn text(text: &str) -> String {
    replace_urls(text, url)
}

/// `text` with every URL in it replaced by `[URL]`. For what a tool server's session says: the
/// server is named in the same message by its registry name.
pub(crate) fn text_without_urls(text: &str) -> String {
    replace_urls(text, |_| "[URL]".to_string())
}

/// `error` and its sources on one line ([`crate::errors::chain`]), every URL in it shown as
/// [`url`] shows it.
pub(crate) fn error_text(error: &dyn Error) -> String {
    text(&crate::errors::chain(error))
}

/// `text` with each URL (found as the module's header says) replaced by `show(url)`.
fn replace_urls(text: &str, show: impl Fn(&str) -> String) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(sep) = rest.find("://") {
        let scheme_start = rest[..sep]
            .char_indices()
            .rev()
            .take_while(|&(_, c)| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            .last()
            .map_or(sep, |(i, _)| i);
        let end = url_end(rest, sep + 3);
        out.push_str(&rest[..scheme_start]);
        out.push_str(&show(&rest[scheme_start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Where the URL whose `://` ends at `start` ends in `text`: at the first white space, quote,
/// backtick or angle bracket, less the closing brackets and punctuation at its end that it does
/// not open.
fn url_end(text: &str, start: usize) -> usize {
    let stops = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>');
    let token_end = text[start..].find(stops).map_or(text.len(), |i| start + i);
    let mut token = &text[start..token_end];
    while let Some(last) = token.chars().last() {
        let opener = match last {
            ')' => '(',
            ']' => '[',
            '}' => '{',
            '.' | ',' | ';' | ':' | '!' => '\0',
            _ => break,
        };
        let kept = &token[..token.len() - last.len_utf8()];
        if opener != '\0' && kept.matches(opener).count() > kept.matches(last).count() {
            break;
        }
        token = kept;
    }
    start + token.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_urls_never_show() {
        for (raw, shown) in [
            (
                "https://user:pw@issuer.example/realms/x?client_secret=s#frag",
                "https://issuer.example/realms/x",
            ),
            ("http://engine:5601/api", "http://engine:5601/api"),
            ("http://issuer:1", "http://issuer:1"),
            ("http://tok@127.0.0.1:9/mcp?key=1", "http://127.0.0.1:9/mcp"),
            ("not a url?secret=1", "not a url"),
            ("weird://a:b@host:x/p#f", "weird://host:x/p"),
            ("//u:p@h/x?q", "//h/x"),
            ("http://u:p/w@h:x/p?q", "http://h:x/p"),
        ] {
            let got = url(raw);
            assert_eq!(got, shown, "{raw}");
            for secret in ["pw", "secret", "frag", "tok@", "key=1", "p/w"] {
                assert!(!got.contains(secret), "{raw} -> {got}");
            }
        }
    }

    #[test]
    fn an_origin_is_scheme_host_and_port() {
        for (raw, shown) in [
            (
                "https://u:pw@h.example:8443/key-in-path/mcp?k=v#f",
                "https://h.example:8443",
            ),
            ("http://h/p", "http://h"),
            ("http://[::1]:9/x", "http://[::1]:9"),
            ("weird://a:b@host:x/p?q", "weird://host:x"),
        ] {
            assert_eq!(origin(raw), shown, "{raw}");
        }
    }

    /// Every URL in a library's message, in the forms reqwest, hyper and rmcp write them.
    #[test]
    fn urls_inside_a_text_lose_their_secrets_and_the_text_keeps_its_shape() {
        let secrets = ["pw1", "k3y", "frag", "p)ss", "s]cret"];
        for (raw, shown) in [
            (
                "error sending request for url (http://u:pw1@h:9/mcp?api_key=k3y)",
                "error sending request for url (http://h:9/mcp)",
            ),
            (
                "worker quit with fatal: Client error: error sending request for url (http://u:pw1@h/mcp?api_key=k3y#frag), when send initialize request",
                "worker quit with fatal: Client error: error sending request for url (http://h/mcp), when send initialize request",
            ),
            (
                "uri: \"https://h/x?api_key=k3y\" and 'http://u:pw1@h2/'.",
                "uri: \"https://h/x\" and 'http://h2/'.",
            ),
            (
                "two: http://a/?k3y http://b/?k3y",
                "two: http://a/ http://b/",
            ),
            (
                "a paren in the query (http://h/x?q=(k3y)&r=k3y)",
                "a paren in the query (http://h/x)",
            ),
            (
                "in a password: http://u:p)ss@h/x?k3y",
                "in a password: http://h/x",
            ),
            ("[http://h/x?k=s]cret]", "[http://h/x]"),
            ("no url here: a://", "no url here: a://"),
            ("ftp+x://u:pw1@h/?k3y.", "ftp+x://h/."),
        ] {
            let got = text(raw);
            assert_eq!(got, shown, "{raw}");
            for secret in secrets {
                assert!(!got.contains(secret), "{raw} -> {got}");
            }
        }
        assert_eq!(
            text_without_urls("cannot connect (http://u:pw1@h/secret-path?k3y): refused"),
            "cannot connect ([URL]): refused"
        );
    }

    #[tokio::test]
    async fn reqwest_errors_lose_the_secret_parts_of_their_url() {
        // Port 1 on loopback refuses the connection; the error names the URL.
        let e = reqwest::get("http://user:pw@127.0.0.1:1/x?token=abc")
            .await
            .unwrap_err();
        let borrowed = error_text(&e);
        assert!(
            !borrowed.contains("abc") && !borrowed.contains("pw"),
            "{borrowed}"
        );
        assert!(borrowed.contains("127.0.0.1:1/x"), "{borrowed}");
        // Wrapped in another error, the URL is still found.
        #[derive(Debug, thiserror::Error)]
        #[error("the call failed")]
        struct Wrapper(#[source] reqwest::Error);
        let wrapped = error_text(&Wrapper(e));
        assert!(
            wrapped.starts_with("the call failed: ") && !wrapped.contains("abc"),
            "{wrapped}"
        );
    }
}
