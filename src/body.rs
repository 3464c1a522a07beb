//! Bodies read from outside the process, always under a byte limit and never buffered whole: the
//! limits in one place, and the one way to read a body (`read_capped`, `read_prefix`, and
//! `decode_streamed` for documents decoded as they arrive). The engine client, the model
//! providers and the OIDC issuer read through here; tool servers are read by rmcp, whose
//! transport gets its limits from the constants below (`tools/session.rs`).
//!
//! The limits are sized against what one slot may hold (four slots under 64 MB of
//! resident memory with any single hostile input): each is far above what a well-behaved peer
//! sends, and small enough that four of them at once stay a fraction of the budget.

use std::io::Read;

use bytes::{Bytes, BytesMut};

/// A model's answer: 2 MiB is several times the largest output any model produces (about 128k
/// tokens of text); a larger answer is hostile or broken.
pub(crate) const MODEL_RESPONSE_MAX_BYTES: usize = 2 * 1024 * 1024;
/// One JSON response or SSE event from a tool server. Results are cut to 64 KiB before the
/// model sees them; this bounds what is read to get there. 4 MiB: a result up to that size is
/// read and cut; a larger one is not read, and the model is told (an SSE event past it too, told
/// apart from a broken stream by `tools::transport`).
pub(crate) const TOOL_RESPONSE_MAX_BYTES: usize = 4 * 1024 * 1024;
/// The diagnostic text of a tool server's non-JSON error answer.
pub(crate) const TOOL_ERROR_BODY_MAX_BYTES: usize = 16 * 1024;
/// A tool error message (JSON-RPC error, protocol failure) as it is kept and shown to the model.
pub(crate) const TOOL_ERROR_MESSAGE_MAX_BYTES: usize = 4 * 1024;
/// Pages of one `tools/list`: a server that keeps sending a next-page cursor is cut here.
pub(crate) const TOOL_LIST_MAX_PAGES: usize = 16;
/// Tools one server may list; a model is offered far fewer in practice.
pub(crate) const TOOL_LIST_MAX_TOOLS: usize = 256;
/// A tool's description as offered to the model; a longer one is cut.
pub const TOOL_DESCRIPTION_MAX_BYTES: usize = 4 * 1024;
/// A tool's input schema (as JSON); a tool with a larger one is not offered.
pub const TOOL_SCHEMA_MAX_BYTES: usize = 32 * 1024;
/// One locked task of a fetch response (its variables and agent definition as JSON). A larger
/// task is not taken: it becomes an incident naming this limit (retrying cannot shrink it).
pub(crate) const TASK_MAX_BYTES: usize = 1024 * 1024;
/// A whole fetch response, read as it arrives (at most one task's bytes are held at a time).
pub(crate) const FETCH_STREAM_MAX_BYTES: usize = 64 * 1024 * 1024;
/// A journal read answer, decoded as it arrives.
pub(crate) const JOURNAL_MAX_BYTES: usize = 8 * 1024 * 1024;
/// Steps of one journal: far above what the limits on turns and tool calls let a task write.
pub const JOURNAL_MAX_STEPS: usize = 4096;
/// A process definition answer (`GET /v1/processes/{id}`): its BPMN XML, escaped in JSON. A
/// model with an agent on every task stays far below; the XML parser gets no more than this.
pub const PROCESS_DEFINITION_MAX_BYTES: usize = 4 * 1024 * 1024;
/// One page of an instance's activity history (100 entries, each a few hundred bytes).
pub(crate) const HISTORY_PAGE_MAX_BYTES: usize = 1024 * 1024;
/// Any other engine answer (errors, tool credentials, empty successes).
pub(crate) const ENGINE_ANSWER_MAX_BYTES: usize = 64 * 1024;
/// An OIDC issuer's documents: discovery, JWKS, token answers.
pub(crate) const ISSUER_DOCUMENT_MAX_BYTES: usize = 256 * 1024;
/// The part of a non-success answer kept to classify and describe it.
pub(crate) const ERROR_BODY_MAX_BYTES: usize = 16 * 1024;

/// An outside body larger than its limit; nothing past the limit was read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} is larger than the worker's limit of {limit} {unit} (at least {seen} {unit}); retrying cannot help"
)]
pub struct TooLarge {
    /// What was too large, for people ("the fetch response", "task t-1").
    pub what: String,
    pub limit: usize,
    /// How many units were known when reading stopped (announced or read).
    pub seen: u64,
    /// What `limit` and `seen` count: [`BYTES`], or [`STEPS`] for a journal's step limit.
    pub unit: &'static str,
}

/// The unit of most limits.
pub(crate) const BYTES: &str = "bytes";
/// The unit of the journal's step limit ([`JOURNAL_MAX_STEPS`]).
pub(crate) const STEPS: &str = "steps";

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
    /// The connection failed or timed out while the body arrived.
    #[error("{}", crate::redact::error_text(.0))]
    Http(#[from] reqwest::Error),
}

/// Reads the whole body, refusing it as soon as it is known to exceed `limit` (a
/// `Content-Length` above it is refused before any byte is read).
pub(crate) async fn read_capped(
    mut response: reqwest::Response,
    limit: usize,
    what: &str,
) -> Result<Vec<u8>, ReadError> {
    let too_large = |seen: u64| TooLarge {
        what: what.to_string(),
        limit,
        seen,
        unit: BYTES,
    };
    let announced = response.content_length();
    if let Some(len) = announced
        && len > limit as u64
    {
        return Err(too_large(len).into());
    }
    // Reserve what was announced (within the limit), else grow as chunks arrive.
    let mut body = Vec::with_capacity(announced.unwrap_or(0) as usize);
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > limit {
            return Err(too_large((body.len() + chunk.len()) as u64).into());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Reads at most `limit` bytes of the body and drops the rest unread (for error answers, whose
/// first bytes are all a message needs).
pub(crate) async fn read_prefix(mut response: reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        let room = limit - body.len();
        if chunk.len() >= room {
            body.extend_from_slice(&chunk[..room]);
            break;
        }
        body.extend_from_slice(&chunk);
    }
    body
}

/// The most of a streamed body [`decode_streamed`] reads on the calling task before it moves the
/// decoding to a blocking thread: a body that ends within it (a fetch answer of a few dozen
/// tasks, the journal of a short run) is decoded right there, without a thread hand-off per
/// answer and a blocking thread per concurrent read. A quarter of [`TASK_MAX_BYTES`], which the
/// decoder of a fetch answer may hold for one task anyway.
pub(crate) const DECODE_IN_PLACE_MAX_BYTES: usize = 256 * 1024;

/// Decodes a body as it arrives, holding at most [`DECODE_IN_PLACE_MAX_BYTES`] of its bytes: a
/// body that ends within them is decoded from memory on the calling task; a longer one is read
/// by `decode` through a blocking [`Read`] on a blocking thread (its first bytes included), so
/// only what the decoder keeps is held. Reading more than `limit` bytes fails the read (the
/// decoder sees an I/O error) and the result is [`ReadError::TooLarge`], whatever `decode`
/// returned; a connection failure is [`ReadError::Http`]. `decode` may also stop early on its
/// own limits.
pub(crate) async fn decode_streamed<T: Send + 'static>(
    mut response: reqwest::Response,
    limit: usize,
    what: &str,
    decode: impl FnOnce(&mut dyn Read) -> T + Send + 'static,
) -> Result<T, ReadError> {
    let too_large = |seen: usize| {
        ReadError::TooLarge(TooLarge {
            what: what.to_string(),
            limit,
            seen: seen as u64,
            unit: BYTES,
        })
    };
    let mut head = BytesMut::new();
    loop {
        let Some(chunk) = response.chunk().await? else {
            // The whole body is here: decode it in place.
            return Ok(decode(&mut &head[..]));
        };
        let read = head.len() + chunk.len();
        if read > limit {
            return Err(too_large(read));
        }
        head.extend_from_slice(&chunk);
        if read > DECODE_IN_PLACE_MAX_BYTES {
            break;
        }
    }
    let handle = tokio::runtime::Handle::current();
    let what = what.to_string();
    let read = head.len();
    let decoded = tokio::task::spawn_blocking(move || {
        let mut reader = ResponseReader {
            response,
            handle,
            pending: head.freeze(),
            read,
            limit,
            failure: None,
        };
        let value = decode(&mut reader);
        match reader.failure {
            Some(Failure::TooLarge(seen)) => Err(ReadError::TooLarge(TooLarge {
                what,
                limit,
                seen,
                unit: BYTES,
            })),
            Some(Failure::Http(e)) => Err(ReadError::Http(e)),
            None => Ok(value),
        }
    })
    .await;
    match decoded {
        Ok(result) => result,
        // The decoder panicked: a bug, not the peer's; surface it as a panic here.
        Err(join) => std::panic::resume_unwind(join.into_panic()),
    }
}

enum Failure {
    TooLarge(u64),
    Http(reqwest::Error),
}

/// A response body as a blocking reader (used on a blocking thread only).
struct ResponseReader {
    response: reqwest::Response,
    handle: tokio::runtime::Handle,
    pending: Bytes,
    read: usize,
    limit: usize,
    failure: Option<Failure>,
}

impl Read for ResponseReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.failure.is_some() {
            return Err(std::io::Error::other("the body could not be read"));
        }
        if self.pending.is_empty() {
            match self.handle.block_on(self.response.chunk()) {
                Ok(Some(chunk)) => {
                    if self.read + chunk.len() > self.limit {
                        self.failure = Some(Failure::TooLarge((self.read + chunk.len()) as u64));
                        return Err(std::io::Error::other("the body exceeds its limit"));
                    }
                    self.read += chunk.len();
                    self.pending = chunk;
                }
                Ok(None) => return Ok(0),
                Err(e) => {
                    self.failure = Some(Failure::Http(e));
                    return Err(std::io::Error::other("the body could not be read"));
                }
            }
        }
        let n = buf.len().min(self.pending.len());
        buf[..n].copy_from_slice(&self.pending[..n]);
        let _ = self.pending.split_to(n);
        Ok(n)
    }
}

/// Cuts `text` to at most `limit` bytes at a character boundary, saying how much was cut.
pub fn truncate_text(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… [{} of {} bytes shown]", &text[..end], end, text.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A loopback server answering every connection with `head` then `body`, in `chunk`-byte
    /// writes.
    async fn serve(head: String, body: Vec<u8>, chunk: usize) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (head, body) = (head.clone(), body.clone());
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await;
                    let _ = socket.write_all(head.as_bytes()).await;
                    for part in body.chunks(chunk.max(1)) {
                        if socket.write_all(part).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        format!("http://{addr}/")
    }

    fn chunked_head() -> String {
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n".into()
    }

    #[tokio::test]
    async fn an_announced_length_above_the_limit_is_refused_before_reading() {
        let body = vec![b'x'; 10_000];
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let url = serve(head, body, 10_000).await;
        let response = reqwest::get(&url).await.unwrap();
        let err = read_capped(response, 1000, "the answer").await.unwrap_err();
        let ReadError::TooLarge(t) = err else {
            panic!("{err}")
        };
        assert_eq!((t.limit, t.seen), (1000, 10_000));
        assert!(t.to_string().contains("limit of 1000 bytes"), "{t}");
    }

    #[tokio::test]
    async fn an_unannounced_body_is_refused_once_it_passes_the_limit() {
        let url = serve(chunked_head(), vec![b'x'; 100_000], 1000).await;
        let response = reqwest::get(&url).await.unwrap();
        let err = read_capped(response, 4096, "the answer").await.unwrap_err();
        let ReadError::TooLarge(t) = err else {
            panic!("{err}")
        };
        // Chunks may coalesce on the way; reading stopped long before the whole body.
        assert!(t.seen > 4096 && t.seen < 100_000, "{t}");
        let url = serve(chunked_head(), vec![b'x'; 4096], 7).await;
        let response = reqwest::get(&url).await.unwrap();
        assert_eq!(read_capped(response, 4096, "x").await.unwrap().len(), 4096);
    }

    #[tokio::test]
    async fn a_prefix_is_cut_at_its_limit() {
        let url = serve(chunked_head(), vec![b'e'; 50_000], 333).await;
        let response = reqwest::get(&url).await.unwrap();
        assert_eq!(read_prefix(response, 1000).await.len(), 1000);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_streamed_decode_holds_no_more_than_its_limit() {
        let doc = serde_json::to_vec(&vec!["abc"; 10_000]).unwrap();
        let url = serve(chunked_head(), doc.clone(), 61).await;
        let response = reqwest::get(&url).await.unwrap();
        let decoded = decode_streamed(response, doc.len(), "doc", |r| {
            serde_json::from_reader::<_, Vec<String>>(r).map_err(|e| e.to_string())
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(decoded.len(), 10_000);
        let url = serve(chunked_head(), doc.clone(), 61).await;
        let response = reqwest::get(&url).await.unwrap();
        let err = decode_streamed(response, 1000, "doc", |r| {
            serde_json::from_reader::<_, Vec<String>>(r).map_err(|e| e.to_string())
        })
        .await
        .unwrap_err();
        assert!(
            matches!(err, ReadError::TooLarge(ref t) if t.limit == 1000),
            "{err}"
        );
    }

    /// Decodes the JSON array of strings at `url` within `limit`, saying on which thread.
    async fn decode_strings(
        url: &str,
        limit: usize,
    ) -> Result<(Vec<String>, std::thread::ThreadId), ReadError> {
        let response = reqwest::get(url).await.unwrap();
        decode_streamed(response, limit, "doc", |r| {
            let v = serde_json::from_reader::<_, Vec<String>>(r).map_err(|e| e.to_string());
            (v, std::thread::current().id())
        })
        .await
        .map(|(v, thread)| (v.unwrap(), thread))
    }

    #[tokio::test]
    async fn a_small_body_is_decoded_on_the_task_without_a_blocking_thread() {
        let doc = serde_json::to_vec(&vec!["abc"; 1000]).unwrap();
        assert!(doc.len() < DECODE_IN_PLACE_MAX_BYTES);
        let url = serve(chunked_head(), doc.clone(), 61).await;
        let (decoded, thread) = decode_strings(&url, doc.len()).await.unwrap();
        assert_eq!(decoded.len(), 1000);
        // A current-thread runtime: the test's own thread is the task's.
        assert_eq!(thread, std::thread::current().id());
        // Over the limit while still read in place: refused, nothing decoded.
        let url = serve(chunked_head(), doc.clone(), 61).await;
        let err = decode_strings(&url, doc.len() - 1).await.unwrap_err();
        assert!(
            matches!(err, ReadError::TooLarge(ref t) if t.limit == doc.len() - 1),
            "{err}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_past_the_in_place_bytes_is_decoded_whole_on_a_blocking_thread() {
        // The bytes read in place come first in what the blocking decoder reads.
        let items: Vec<String> = (0..40_000).map(|i| format!("item-{i}")).collect();
        let doc = serde_json::to_vec(&items).unwrap();
        assert!(doc.len() > DECODE_IN_PLACE_MAX_BYTES + 20_000);
        let url = serve(chunked_head(), doc.clone(), 4093).await;
        let (decoded, thread) = decode_strings(&url, doc.len()).await.unwrap();
        assert_eq!(decoded, items);
        assert_ne!(thread, std::thread::current().id());
        // The limit still holds past the in-place bytes.
        let url = serve(chunked_head(), doc.clone(), 4093).await;
        let limit = DECODE_IN_PLACE_MAX_BYTES + 10_000;
        let err = decode_strings(&url, limit).await.unwrap_err();
        assert!(
            matches!(err, ReadError::TooLarge(ref t) if t.limit == limit && t.seen > limit as u64),
            "{err}"
        );
    }

    #[test]
    fn text_is_cut_at_a_character_boundary() {
        assert_eq!(truncate_text("short", 10), "short");
        let cut = truncate_text(&"é".repeat(100), 5);
        assert!(cut.starts_with("éé…"), "{cut}");
        assert!(cut.contains("4 of 200 bytes"), "{cut}");
    }
}
