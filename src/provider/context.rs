//! The context window of each model: how many tokens one request (its input and the output it
//! may produce) can hold. The operator's `ABADA_AGENT_PROVIDER_<NAME>_CONTEXT_WINDOW` wins; else
//! a small table of common models, each figure from its vendor's model documentation; else
//! unknown (the worker then elides nothing, and a model's own refusal ends the task as
//! [`super::ProviderError::ContextTooLong`] does).

use super::ModelRef;

/// The smallest window a provider may be configured with: below it no instruction, input and
/// answer fit.
pub(crate) const MIN_CONTEXT_WINDOW: u64 = 256;
/// The largest configurable window (ten million tokens): more is a typing error.
pub(crate) const MAX_CONTEXT_WINDOW: u64 = 10_000_000;

/// Known windows by model-name prefix, longest prefix first where two overlap. Sources, as
/// their vendors documented them when this table was written:
/// - OpenAI, platform.openai.com/docs/models (each model's page, "Context window"): gpt-4.1,
///   -mini, -nano 1,047,576; gpt-4o and gpt-4o-mini 128,000; o1, o3, o3-mini, o4-mini 200,000;
///   o1-mini 128,000; gpt-4-turbo 128,000; gpt-4 8,192; gpt-3.5-turbo 16,385.
/// - Anthropic, docs.anthropic.com "Models overview" ("Context window"): every Claude 3, 3.5,
///   3.7, 4 and 4.x model 200,000 (the 1M window of some Sonnet models is a beta the worker
///   does not ask for).
///
/// A prefix covers dated versions (`gpt-4o-2024-08-06`, `claude-sonnet-4-20250514`). Models
/// whose input limit is below their advertised window (gpt-5: 400,000 with at most 272,000 of
/// input) are left out rather than overstated: configure them.
const KNOWN: &[(&str, u64)] = &[
    ("gpt-4.1", 1_047_576),
    ("gpt-4o", 128_000),
    ("gpt-4-turbo", 128_000),
    ("gpt-4", 8_192),
    ("gpt-3.5-turbo", 16_385),
    ("o1-mini", 128_000),
    ("o1", 200_000),
    ("o3", 200_000),
    ("o4-mini", 200_000),
    ("claude-", 200_000),
];

/// The window the vendor documents for `model` (the provider-local name), if it is a common
/// one. A gateway's `azure/gpt-4o` is `gpt-4o` here: the name is what the table knows.
fn known_window(model: &str) -> Option<u64> {
    let model = model.trim().to_ascii_lowercase();
    // Gateways prefix vendors' names (`openai/gpt-4o` under OpenRouter): the last segment.
    let model = model.rsplit('/').next().unwrap_or_default();
    KNOWN
        .iter()
        .filter(|(prefix, _)| {
            model.strip_prefix(prefix).is_some_and(|rest| {
                // `gpt-4` must not claim `gpt-4o` or `gpt-4.1`: a prefix ends at a separator.
                rest.is_empty() || rest.starts_with('-') || prefix.ends_with('-')
            })
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, tokens)| *tokens)
}

/// The window of each model a chain may call, as far as known: the configured one of its
/// provider, else the table's.
#[derive(Clone, Debug, Default)]
pub(crate) struct ContextWindows {
    configured: std::collections::HashMap<String, u64>,
}

impl ContextWindows {
    /// Sets the window of every model of provider `name` (`_CONTEXT_WINDOW`).
    pub fn configure(&mut self, provider: impl Into<String>, tokens: u64) {
        self.configured.insert(provider.into(), tokens);
    }

    /// The window of `model`, if configured or known.
    pub fn of(&self, model: &ModelRef) -> Option<u64> {
        self.configured
            .get(&model.provider)
            .copied()
            .or_else(|| known_window(&model.model))
    }

    /// The smallest window among `models` whose window is known, with that model: a request
    /// that fits it fits whichever model of the chain answers. None when no window is known.
    pub(crate) fn smallest<'m>(&self, models: &'m [ModelRef]) -> Option<(&'m ModelRef, u64)> {
        models
            .iter()
            .filter_map(|m| self.of(m).map(|w| (m, w)))
            .min_by_key(|(_, w)| *w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_models_have_their_vendors_windows_and_prefixes_end_at_a_separator() {
        assert_eq!(known_window("gpt-4o"), Some(128_000));
        assert_eq!(known_window("gpt-4o-mini-2024-07-18"), Some(128_000));
        assert_eq!(known_window("gpt-4.1-mini"), Some(1_047_576));
        assert_eq!(known_window("gpt-4"), Some(8_192));
        assert_eq!(known_window("gpt-4-0613"), Some(8_192));
        assert_eq!(known_window("gpt-4-turbo-preview"), Some(128_000));
        assert_eq!(known_window("o1-mini"), Some(128_000));
        assert_eq!(known_window("o3-mini"), Some(200_000));
        assert_eq!(known_window("claude-sonnet-4-20250514"), Some(200_000));
        assert_eq!(known_window("openai/gpt-4o"), Some(128_000));
        assert_eq!(known_window("GPT-4o"), Some(128_000));
        // Names that merely begin like a known one are unknown, not guessed.
        for unknown in [
            "gpt-5",
            "gpt-4x",
            "o1x",
            "o30",
            "gemma-3-270m",
            "",
            "claude",
        ] {
            assert_eq!(known_window(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn the_configured_window_wins_and_a_chain_fits_its_smallest_model() {
        let chain = [
            ModelRef::parse("openai/gpt-4.1").unwrap(),
            ModelRef::parse("local/gemma").unwrap(),
            ModelRef::parse("anthropic/claude-3-5-haiku").unwrap(),
            ModelRef::parse("other/mystery").unwrap(),
        ];
        let mut windows = ContextWindows::default();
        assert_eq!(windows.smallest(&chain[1..2]), None);
        assert_eq!(windows.smallest(&chain).map(|(_, w)| w), Some(200_000));
        windows.configure("local", 4096);
        let (model, w) = windows.smallest(&chain).unwrap();
        assert_eq!((model.to_string().as_str(), w), ("local/gemma", 4096));
        windows.configure("openai", 1000);
        assert_eq!(windows.of(&chain[0]), Some(1000));
    }
}
