//! A connection whose first bytes an entrance has read already (a
//! transparent connection's ClientHello or request head, read to tell what
//! it carries): reads give those bytes first, then the connection's; writes
//! go to the connection. The bytes are dropped once read.

use bytes::{Buf as _, Bytes};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub struct Prefixed<T> {
    early: Bytes,
    io: T,
}

impl<T> Prefixed<T> {
    pub fn new(early: Bytes, io: T) -> Prefixed<T> {
        Prefixed { early, io }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.early.is_empty() {
            return Pin::new(&mut self.io).poll_read(cx, buf);
        }
        let n = self.early.len().min(buf.remaining());
        buf.put_slice(&self.early[..n]);
        self.early.advance(n);
        if self.early.is_empty() {
            // Frees the buffer the bytes were read into.
            self.early = Bytes::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test]
    async fn the_bytes_read_already_come_first_in_any_read_size() {
        let (a, mut b) = tokio::io::duplex(64);
        b.write_all(b" world").await.unwrap();
        drop(b);
        let mut p = Prefixed::new(Bytes::from_static(b"hello"), a);
        let mut small = [0u8; 2];
        assert_eq!(p.read(&mut small).await.unwrap(), 2);
        assert_eq!(&small, b"he");
        let mut rest = vec![];
        p.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"llo world");
        // Writes go to the connection.
        let (a, mut b) = tokio::io::duplex(64);
        let mut p = Prefixed::new(Bytes::new(), a);
        p.write_all(b"up").await.unwrap();
        let mut got = [0u8; 2];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"up");
    }
}
