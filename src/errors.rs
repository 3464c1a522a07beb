//! Errors for people: [`chain`] puts an error and its sources on one line. HTTP and TLS errors
//! (reqwest, hyper, rustls, rmcp) keep the useful part (refused, reset, which certificate) in
//! their sources, and `Display` shows only the top, so every message that names a lower-level
//! failure goes through here.

use std::error::Error;

/// `error: source: source of source ...`, skipping a source whose text the line already holds
/// (many errors repeat their source in their own message).
pub fn chain(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{text}")]
    struct E {
        text: &'static str,
        #[source]
        source: Option<Box<E>>,
    }

    fn e(text: &'static str, source: Option<E>) -> E {
        E {
            text,
            source: source.map(Box::new),
        }
    }

    #[test]
    fn every_source_is_on_the_line_once() {
        let inner = e("Connection refused (os error 111)", None);
        let middle = e("tcp connect error", Some(inner));
        let top = e("error sending request", Some(middle));
        assert_eq!(
            chain(&top),
            "error sending request: tcp connect error: Connection refused (os error 111)"
        );
        let repeats = e(
            "client error (tcp connect error)",
            Some(e("tcp connect error", None)),
        );
        assert_eq!(chain(&repeats), "client error (tcp connect error)");
        assert_eq!(chain(&e("alone", None)), "alone");
    }
}
