//! The request/response codec for stage work: a 4-byte little-endian length, then the bincode
//! message. Lengths above the cap are refused before anything is allocated.

use std::io;
use std::marker::PhantomData;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::request_response;
use libp2p::StreamProtocol;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Length-prefixed bincode frames with separate caps for requests and responses.
#[derive(Debug)]
pub struct FrameCodec<Req, Resp> {
    max_request: usize,
    max_response: usize,
    _types: PhantomData<fn() -> (Req, Resp)>,
}

impl<Req, Resp> Clone for FrameCodec<Req, Resp> {
    fn clone(&self) -> Self {
        FrameCodec {
            max_request: self.max_request,
            max_response: self.max_response,
            _types: PhantomData,
        }
    }
}

impl<Req, Resp> FrameCodec<Req, Resp> {
    /// A codec refusing requests over `max_request` bytes and responses over `max_response`.
    pub fn new(max_request: usize, max_response: usize) -> Self {
        FrameCodec {
            max_request,
            max_response,
            _types: PhantomData,
        }
    }
}

/// Reads one frame of at most `max` bytes.
pub async fn read_frame<T: AsyncRead + Unpin>(io: &mut T, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    io.read_exact(&mut buf).await?;
    Ok(buf)
}

/// Writes one frame.
pub async fn write_frame<T: AsyncWrite + Unpin>(io: &mut T, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame larger than 4 GiB"))?;
    io.write_all(&len.to_le_bytes()).await?;
    io.write_all(bytes).await?;
    io.flush().await
}

fn invalid(e: dc_types::WireError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl<Req, Resp> request_response::Codec for FrameCodec<Req, Resp>
where
    Req: Serialize + DeserializeOwned + Send + 'static,
    Resp: Serialize + DeserializeOwned + Send + 'static,
{
    type Protocol = StreamProtocol;
    type Request = Req;
    type Response = Resp;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Req>
    where
        T: AsyncRead + Unpin + Send,
    {
        // Failures here never reach the behaviour's events (the request was never read), so
        // they are logged where they happen.
        let bytes = read_frame(io, self.max_request).await.inspect_err(|e| {
            tracing::warn!("refused a stage request: {e}");
        })?;
        dc_types::decode(&bytes, self.max_request)
            .map_err(invalid)
            .inspect_err(|e| tracing::warn!("refused a stage request: {e}"))
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<Resp>
    where
        T: AsyncRead + Unpin + Send,
    {
        let bytes = read_frame(io, self.max_response).await?;
        dc_types::decode(&bytes, self.max_response).map_err(invalid)
    }

    async fn write_request<T>(&mut self, _: &StreamProtocol, io: &mut T, req: Req) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        let bytes = dc_types::encode(&req, self.max_request).map_err(invalid)?;
        write_frame(io, &bytes).await?;
        io.close().await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: Resp,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        let bytes = dc_types::encode(&res, self.max_response).map_err(invalid)?;
        write_frame(io, &bytes).await?;
        io.close().await
    }
}
