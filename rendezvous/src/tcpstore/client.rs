//! A small TCPStore client speaking the raw protocol: one connection, one request at a time, keys
//! sent exactly as given (torch's own client prepends `/` to user keys; this one does not).
//!
//! It is for tests, benchmarks and probes; unlike torch's client its GET does not WAIT first, so
//! a missing key reads as an empty value.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::RdzvError;
use crate::tcpstore::proto::{Request, VALIDATE_MAGIC};

/// One connection to a TCPStore server.
#[derive(Debug)]
pub struct TcpStoreClient {
    addr: SocketAddr,
    stream: BufReader<TcpStream>,
    buf: Vec<u8>,
}

impl TcpStoreClient {
    /// Connects, sends VALIDATE and checks a PING echo, as torch ≥ 2.5 clients do.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] when the connection fails or the echo differs.
    pub async fn connect(addr: SocketAddr) -> Result<TcpStoreClient, RdzvError> {
        let stream = TcpStream::connect(addr).await.map_err(|e| io_err(addr, "connect", e))?;
        stream.set_nodelay(true).map_err(|e| io_err(addr, "set TCP_NODELAY", e))?;
        let mut client = TcpStoreClient { addr, stream: BufReader::new(stream), buf: Vec::new() };
        let nonce = std::process::id();
        client.send_all(&[Request::Validate { magic: VALIDATE_MAGIC }, Request::Ping { nonce }]).await?;
        let echo = client.read_u32().await?;
        if echo != nonce {
            return Err(client.err(format!("PING echoed {echo:#x}, sent {nonce:#x}")));
        }
        Ok(client)
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends requests without reading anything (for requests without a reply, or pipelining).
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] when the write fails.
    pub async fn send_all(&mut self, reqs: &[Request]) -> Result<(), RdzvError> {
        self.buf.clear();
        for r in reqs {
            r.encode(&mut self.buf);
        }
        let buf = std::mem::take(&mut self.buf);
        let r = self.stream.get_mut().write_all(&buf).await;
        self.buf = buf;
        r.map_err(|e| io_err(self.addr, "write", e))
    }

    /// SET (no reply).
    ///
    /// # Errors
    /// As [`TcpStoreClient::send_all`].
    pub async fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), RdzvError> {
        self.send_all(&[Request::Set { key: key.to_vec(), value: value.to_vec() }]).await
    }

    /// GET; a missing key reads as empty.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure.
    pub async fn get(&mut self, key: &[u8]) -> Result<Vec<u8>, RdzvError> {
        self.send_all(&[Request::Get { key: key.to_vec() }]).await?;
        self.read_bytes().await
    }

    /// ADD; returns the new value.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure (the server closes on a non-numeric value).
    pub async fn add(&mut self, key: &[u8], delta: i64) -> Result<i64, RdzvError> {
        self.send_all(&[Request::Add { key: key.to_vec(), delta }]).await?;
        self.read_i64().await
    }

    /// COMPARE_SET; returns the server's reply (see tcpstore.md §4.3).
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure.
    pub async fn compare_set(&mut self, key: &[u8], expected: &[u8], desired: &[u8]) -> Result<Vec<u8>, RdzvError> {
        self.send_all(&[Request::CompareSet { key: key.to_vec(), expected: expected.to_vec(), desired: desired.to_vec() }])
            .await?;
        self.read_bytes().await
    }

    /// CHECK; true when every key exists.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure or an unexpected reply byte.
    pub async fn check(&mut self, keys: &[&[u8]]) -> Result<bool, RdzvError> {
        self.send_all(&[Request::Check { keys: keys.iter().map(|k| k.to_vec()).collect() }]).await?;
        match self.read_u8().await? {
            0 => Ok(true),
            1 => Ok(false),
            b => Err(self.err(format!("CHECK replied {b:#04x}"))),
        }
    }

    /// WAIT until every key exists (no client-side timeout: wrap it in one).
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure or an unexpected reply byte.
    pub async fn wait(&mut self, keys: &[&[u8]]) -> Result<(), RdzvError> {
        self.send_all(&[Request::Wait { keys: keys.iter().map(|k| k.to_vec()).collect() }]).await?;
        self.expect_u8(0, "WAIT").await
    }

    /// GETNUMKEYS.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure.
    pub async fn num_keys(&mut self) -> Result<i64, RdzvError> {
        self.send_all(&[Request::GetNumKeys]).await?;
        self.read_i64().await
    }

    /// DELETE_KEY; true when the key existed.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure.
    pub async fn delete_key(&mut self, key: &[u8]) -> Result<bool, RdzvError> {
        self.send_all(&[Request::DeleteKey { key: key.to_vec() }]).await?;
        Ok(self.read_i64().await? == 1)
    }

    /// MULTI_GET; missing keys read as empty.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure.
    pub async fn multi_get(&mut self, keys: &[&[u8]]) -> Result<Vec<Vec<u8>>, RdzvError> {
        self.send_all(&[Request::MultiGet { keys: keys.iter().map(|k| k.to_vec()).collect() }]).await?;
        let mut out = Vec::with_capacity(keys.len());
        for _ in keys {
            out.push(self.read_bytes().await?);
        }
        Ok(out)
    }

    /// QUEUE_POP; `None` when the queue was empty.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure.
    pub async fn queue_pop(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, RdzvError> {
        self.send_all(&[Request::QueuePop { key: key.to_vec() }]).await?;
        if self.read_i64().await? > 0 { Ok(Some(self.read_bytes().await?)) } else { Ok(None) }
    }

    /// LIST_KEYS: every raw key.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure.
    pub async fn list_keys(&mut self) -> Result<Vec<Vec<u8>>, RdzvError> {
        self.send_all(&[Request::ListKeys]).await?;
        let n = self.read_i64().await?;
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(self.read_bytes().await?);
        }
        Ok(out)
    }

    /// BARRIER: returns once `world_size` calls on `key` were made (ever, the counter never resets).
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure or an unexpected reply byte.
    pub async fn barrier(&mut self, key: &[u8], world_size: i64) -> Result<(), RdzvError> {
        self.send_all(&[Request::Barrier { key: key.to_vec(), world_size }]).await?;
        self.expect_u8(0, "BARRIER").await
    }

    /// PING; checks the echo.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure or a wrong echo.
    pub async fn ping(&mut self, nonce: u32) -> Result<(), RdzvError> {
        self.send_all(&[Request::Ping { nonce }]).await?;
        let echo = self.read_u32().await?;
        if echo != nonce {
            return Err(self.err(format!("PING echoed {echo:#x}, sent {nonce:#x}")));
        }
        Ok(())
    }

    /// Reads one byte of a reply.
    ///
    /// # Errors
    /// [`RdzvError::TcpStoreClient`] on an I/O failure or end of stream.
    pub async fn read_u8(&mut self) -> Result<u8, RdzvError> {
        self.stream.read_u8().await.map_err(|e| io_err(self.addr, "read", e))
    }

    /// Reads a native-endian `u32` reply.
    ///
    /// # Errors
    /// As [`TcpStoreClient::read_u8`].
    pub async fn read_u32(&mut self) -> Result<u32, RdzvError> {
        self.stream.read_u32_le().await.map_err(|e| io_err(self.addr, "read", e))
    }

    /// Reads a native-endian `i64` reply.
    ///
    /// # Errors
    /// As [`TcpStoreClient::read_u8`].
    pub async fn read_i64(&mut self) -> Result<i64, RdzvError> {
        self.stream.read_i64_le().await.map_err(|e| io_err(self.addr, "read", e))
    }

    /// Reads a `u64 len ‖ bytes` reply.
    ///
    /// # Errors
    /// As [`TcpStoreClient::read_u8`].
    pub async fn read_bytes(&mut self) -> Result<Vec<u8>, RdzvError> {
        let len = self.stream.read_u64_le().await.map_err(|e| io_err(self.addr, "read", e))?;
        // The buffer grows with what arrives: a length the server sent is no allocation size.
        let mut v = Vec::with_capacity(usize::try_from(len).unwrap_or(usize::MAX).min(1 << 20));
        (&mut self.stream).take(len).read_to_end(&mut v).await.map_err(|e| io_err(self.addr, "read", e))?;
        if (v.len() as u64) < len {
            return Err(io_err(self.addr, "read", std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("reply of {len} bytes ended after {}", v.len()))));
        }
        Ok(v)
    }

    async fn expect_u8(&mut self, want: u8, what: &str) -> Result<(), RdzvError> {
        let b = self.read_u8().await?;
        if b != want {
            return Err(self.err(format!("{what} replied {b:#04x}, expected {want:#04x}")));
        }
        Ok(())
    }

    fn err(&self, message: String) -> RdzvError {
        RdzvError::TcpStoreClient { addr: self.addr.to_string(), message }
    }
}

fn io_err(addr: SocketAddr, what: &str, e: std::io::Error) -> RdzvError {
    RdzvError::TcpStoreClient { addr: addr.to_string(), message: format!("{what}: {e}") }
}
