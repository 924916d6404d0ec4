//! The capture stage: a child's stdout and stderr read by background tasks
//! into bounded buffers (the first bytes of stdout, the last bytes of
//! stderr, and the total seen).

use std::sync::{Arc, Mutex};

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;

/// Bytes kept from one output stream: the first `head_cap` and the last
/// `tail_cap` bytes, with the total seen.
#[derive(Debug, Default)]
pub struct Captured {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    head_cap: usize,
    tail_cap: usize,
    total: u64,
}

impl Captured {
    pub fn new(head_cap: usize, tail_cap: usize) -> Self {
        Captured {
            head_cap,
            tail_cap,
            ..Default::default()
        }
    }

    fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.head_cap {
            let n = (self.head_cap - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if self.tail_cap == 0 {
            return;
        }
        if data.len() >= self.tail_cap {
            data = &data[data.len() - self.tail_cap..];
            self.tail.clear();
        }
        let excess = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
        self.tail.drain(..excess);
        self.tail.extend(data);
    }

    /// The head as text (lossy), marked if the stream was longer.
    pub fn head_text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.head).into_owned();
        let shown = self.head.len() as u64 + self.tail.len() as u64;
        if self.total > shown && self.tail_cap == 0 {
            s.push_str(&format!("\n[… {} more bytes not kept]", self.total - shown));
        }
        s
    }

    /// The last bytes as text (lossy), marked if earlier bytes were dropped.
    pub fn tail_text(&self) -> String {
        if self.head_cap > 0 && self.tail.is_empty() {
            return String::from_utf8_lossy(&self.head).into_owned();
        }
        let bytes: Vec<u8> = self.tail.iter().copied().collect();
        let s = String::from_utf8_lossy(&bytes).into_owned();
        if self.total > bytes.len() as u64 {
            format!("[… {} earlier bytes not kept]\n{s}", self.total - bytes.len() as u64)
        } else {
            s
        }
    }
}

/// A stream being captured by a background task.
#[derive(Debug)]
pub struct Capture {
    buf: Arc<Mutex<Captured>>,
    task: tokio::task::JoinHandle<()>,
}

impl Capture {
    /// Start reading `rx` into a buffer keeping `head`/`tail` bytes.
    pub fn start(rx: pipe::Receiver, head: usize, tail: usize) -> Capture {
        let buf = Arc::new(Mutex::new(Captured::new(head, tail)));
        let b = buf.clone();
        let task = tokio::spawn(async move {
            let mut rx = rx;
            let mut chunk = vec![0u8; 16 * 1024];
            loop {
                match rx.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if let Ok(mut g) = b.lock() {
                            g.push(&chunk[..n]);
                        }
                    }
                }
            }
        });
        Capture { buf, task }
    }

    /// Wait up to `grace` for the writer side to close (every holder of the
    /// pipe dead), then stop reading and return what was kept. The grace only
    /// matters when a descendant escaped the kill and still holds the pipe.
    pub async fn finish(self, grace: std::time::Duration) -> Captured {
        let mut task = self.task;
        if tokio::time::timeout(grace, &mut task).await.is_err() {
            task.abort();
        }
        match self.buf.lock() {
            Ok(mut g) => std::mem::take(&mut *g),
            Err(_) => Captured::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_keeps_head_and_tail() {
        let mut c = Captured::new(4, 0);
        c.push(b"abcdefgh");
        assert_eq!(c.head_text(), "abcd\n[… 4 more bytes not kept]");
        let mut t = Captured::new(0, 4);
        t.push(b"abc");
        t.push(b"defgh");
        assert_eq!(t.tail_text(), "[… 4 earlier bytes not kept]\nefgh");
        let mut s = Captured::new(0, 10);
        s.push(b"short");
        assert_eq!(s.tail_text(), "short");
    }
}
