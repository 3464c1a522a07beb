//! A base URL parsed once (the engine's API root, a provider's base URL), and the request URLs
//! made from it: a path appended to the base's own path, without parsing the scheme and the
//! host again for every request. A full parse was about 7 k instructions per request, a
//! hundredth of a task's, and reqwest parses a `&str` URL once more on its own.
//!
//! The URL made is the one a parse of the base and the path written one after the other would
//! give (`join_is_the_parse_of_the_concatenation`): the same path rules (dot segments, percent
//! encoding), since both go through the same path parser.

use reqwest::Url;

/// A parsed `http(s)` base URL with no query, fragment or credentials.
#[derive(Clone, Debug)]
pub(crate) struct BaseUrl {
    url: Url,
    /// The base's path without its trailing `/`: `""` for `http://host`, `/api` for
    /// `http://host/api/`.
    path: String,
}

impl BaseUrl {
    /// Parses `raw` as a base for request URLs. Refused: anything but `http` and `https`, no
    /// host, a query or fragment (a path appended after them would be read as part of them),
    /// and a user name or password (they would be sent with every request and shown with the
    /// URL in messages; authenticate with the headers or OIDC instead).
    pub(crate) fn parse(raw: &str) -> Result<BaseUrl, String> {
        let url = Url::parse(raw).map_err(|e| e.to_string())?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "the scheme {:?} is not http or https",
                url.scheme()
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err("it has no host".into());
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err("it has a query or a fragment (`?` or `#`): give the root only".into());
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(
                "it holds a user name or password: they would be sent and shown with the URL; authenticate with headers or OIDC instead"
                    .into(),
            );
        }
        let path = url.path().trim_end_matches('/').to_string();
        Ok(BaseUrl { url, path })
    }

    /// The base with `path` (starting with `/`, its segments percent-encoded) appended.
    pub(crate) fn join(&self, path: &str) -> Url {
        let mut url = self.url.clone();
        let mut full = String::with_capacity(self.path.len() + path.len());
        full.push_str(&self.path);
        full.push_str(path);
        url.set_path(&full);
        url
    }

    pub(crate) fn host(&self) -> &str {
        self.url.host_str().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_is_the_parse_of_the_concatenation() {
        let bases = [
            "http://e:5601/api",
            "http://e:5601/api/",
            "http://e",
            "http://e/",
            "https://[::1]:8443/a/b",
            "http://127.0.0.1:9/v%20x",
            "http://E.Example/Api",
        ];
        let paths = [
            "/v1/external-tasks/fetch-and-lock",
            "/v1/external-tasks/a%2Fb%20c%3F/complete",
            "/v1/external-tasks/%C3%A9/journal/read",
            "/v1/processes/a%2F..%2Fb",
            "/v1/processes/%252e%252e",
            "/chat/completions",
            "/x/../y",
            "/x/./y",
            "/x/%2e%2e/y",
            "/ü/ space",
            "",
        ];
        for base in bases {
            let b = BaseUrl::parse(base).unwrap();
            for path in paths {
                let joined = b.join(path);
                let parsed = Url::parse(&format!("{}{path}", base.trim_end_matches('/'))).unwrap();
                assert_eq!(joined, parsed, "{base} + {path}");
                assert_eq!(joined.as_str(), parsed.as_str());
            }
        }
    }

    #[test]
    fn a_base_read_two_ways_is_refused() {
        for (raw, why) in [
            ("http://e/api?x=1", "query"),
            ("http://e/api#f", "fragment"),
            ("http://u:p@e/api", "password"),
            ("http://u@e/api", "user name"),
            ("ftp://e/api", "scheme"),
            ("file:///etc/passwd", "scheme"),
            ("e:5601/api", "scheme"),
            ("http://", "host"),
            ("not a url", "relative URL"),
        ] {
            let e = BaseUrl::parse(raw).unwrap_err();
            assert!(e.contains(why), "{raw}: {e}");
        }
    }

    #[test]
    fn the_host_is_the_parsed_one() {
        assert_eq!(
            BaseUrl::parse("http://E.example:1/api").unwrap().host(),
            "e.example"
        );
        assert_eq!(BaseUrl::parse("http://[::1]:1").unwrap().host(), "[::1]");
    }
}
