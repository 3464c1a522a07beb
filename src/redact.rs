//! URLs as they may be shown: every URL that reaches a log line, an error, a metric or a report
//! to the engine goes through [`url`], which drops the parts that carry secrets (userinfo, query,
//! fragment). One function, so no display path can forget a part.

/// `raw` without userinfo, query and fragment: `https://user:pw@host/p?key=v#f` shows as
/// `https://host/p`. Text that does not parse as a URL is cut the same way by hand (at `?`/`#`,
/// and anything before an `@` in the authority dropped), so a malformed URL cannot leak either.
pub fn url(raw: &str) -> String {
    if let Ok(mut parsed) = reqwest::Url::parse(raw)
        && parsed.has_host()
    {
        let _ = parsed.set_username("");
        let _ = parsed.set_password(None);
        parsed.set_query(None);
        parsed.set_fragment(None);
        return parsed.to_string();
    }
    let cut = raw.find(['?', '#']).map_or(raw, |i| &raw[..i]);
    let (scheme, rest) = match cut.find("//") {
        Some(i) => (&cut[..i + 2], &cut[i + 2..]),
        None => ("", cut),
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}{host}{path}")
}

/// A borrowed reqwest error's text with its cause chain, its URL shown as [`url`] shows it
/// (reqwest writes the whole URL, query included, into its message).
pub(crate) fn reqwest_error_text(e: &reqwest::Error) -> String {
    let text = crate::errors::chain(e);
    match e.url() {
        Some(u) => text.replace(u.as_str(), &url(u.as_str())),
        None => text,
    }
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
            ("http://tok@127.0.0.1:9/mcp?key=1", "http://127.0.0.1:9/mcp"),
            ("not a url?secret=1", "not a url"),
            ("weird://a:b@host:x/p#f", "weird://host:x/p"),
            ("//u:p@h/x?q", "//h/x"),
        ] {
            let got = url(raw);
            assert_eq!(got, shown, "{raw}");
            for secret in ["pw", "secret", "frag", "tok@", "key=1"] {
                assert!(!got.contains(secret), "{raw} -> {got}");
            }
        }
    }

    #[tokio::test]
    async fn reqwest_errors_lose_the_secret_parts_of_their_url() {
        // Port 1 on loopback refuses the connection; the error names the URL.
        let e = reqwest::get("http://user:pw@127.0.0.1:1/x?token=abc")
            .await
            .unwrap_err();
        let borrowed = reqwest_error_text(&e);
        assert!(
            !borrowed.contains("abc") && !borrowed.contains("pw"),
            "{borrowed}"
        );
        assert!(borrowed.contains("127.0.0.1:1/x"), "{borrowed}");
    }
}
