//! A bounded WebSocket frame codec (RFC 6455 §5) for the connections whose
//! frames the proxy reads (`rewrite_websocket`): [`parse`] one frame from
//! the front of a buffer (FIN, RSV, opcode, mask, 7/16/64-bit length),
//! [`Messages`] joins data frames into messages (fragmentation, control
//! frames interleaved), [`encode`] writes one frame (masked for the origin,
//! as clients must). Every length is checked against a cap before any byte
//! of the payload is held, so a peer can make the proxy hold at most the
//! cap per direction.

/// A frame's opcode (RFC 6455 §5.2).
pub const CONTINUATION: u8 = 0x0;
pub const TEXT: u8 = 0x1;
pub const BINARY: u8 = 0x2;
pub const CLOSE: u8 = 0x8;
pub const PING: u8 = 0x9;
pub const PONG: u8 = 0xA;

/// A control frame's payload is at most this long (§5.5).
pub const MAX_CONTROL: usize = 125;

/// One frame, its payload unmasked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub fin: bool,
    pub opcode: u8,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn is_control(&self) -> bool {
        self.opcode & 0x8 != 0
    }
}

/// Why a stream of frames cannot be carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// A frame or message longer than the cap (the length it announced,
    /// or reached).
    TooBig(u64),
    /// Not a frame RFC 6455 allows here.
    Protocol(&'static str),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooBig(n) => write!(f, "a WebSocket message of {n} bytes or more is over the proxy's cap"),
            FrameError::Protocol(m) => write!(f, "WebSocket protocol error: {m}"),
        }
    }
}

/// Parses the frame at the front of `buf`: `Ok(None)` until it is whole,
/// then the frame and the bytes it took. `masked`: whether frames from
/// this peer must be masked (the client's, §5.1) or must not be (the
/// server's). A payload longer than `max` is refused from its header.
pub fn parse(buf: &[u8], masked: bool, max: usize) -> Result<Option<(Frame, usize)>, FrameError> {
    let [b0, b1, ..] = *buf else { return Ok(None) };
    let fin = b0 & 0x80 != 0;
    if b0 & 0x70 != 0 {
        // No extension is negotiated on a connection the proxy reads.
        return Err(FrameError::Protocol("reserved bits set without an extension"));
    }
    let opcode = b0 & 0x0F;
    if !matches!(opcode, CONTINUATION | TEXT | BINARY | CLOSE | PING | PONG) {
        return Err(FrameError::Protocol("reserved opcode"));
    }
    let has_mask = b1 & 0x80 != 0;
    if has_mask != masked {
        return Err(FrameError::Protocol(if masked {
            "an unmasked frame from the client"
        } else {
            "a masked frame from the server"
        }));
    }
    let (len, mut at) = match b1 & 0x7F {
        126 => match buf.get(2..4) {
            Some(b) => (u64::from(u16::from_be_bytes([b[0], b[1]])), 4),
            None => return Ok(None),
        },
        127 => match buf.get(2..10) {
            Some(b) => {
                let mut n = [0u8; 8];
                n.copy_from_slice(b);
                let n = u64::from_be_bytes(n);
                if n >> 63 != 0 {
                    return Err(FrameError::Protocol("a 64-bit length with its high bit set"));
                }
                (n, 10)
            }
            None => return Ok(None),
        },
        n => (u64::from(n), 2),
    };
    if opcode & 0x8 != 0 && (!fin || len > MAX_CONTROL as u64) {
        return Err(FrameError::Protocol("a fragmented or long control frame"));
    }
    if len > max as u64 {
        return Err(FrameError::TooBig(len));
    }
    let len = len as usize;
    let mask = if masked {
        let Some(m) = buf.get(at..at + 4) else { return Ok(None) };
        at += 4;
        Some([m[0], m[1], m[2], m[3]])
    } else {
        None
    };
    let Some(data) = buf.get(at..at + len) else {
        return Ok(None);
    };
    let mut payload = data.to_vec();
    if let Some(m) = mask {
        apply_mask(&mut payload, m);
    }
    Ok(Some((Frame { fin, opcode, payload }, at + len)))
}

/// XORs `data` with the masking key (§5.3); masking twice unmasks.
pub fn apply_mask(data: &mut [u8], mask: [u8; 4]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b ^= mask[i % 4];
    }
}

/// Writes one frame: FIN, `opcode`, the shortest length form, and the
/// payload masked with `mask` when given (frames to the origin).
pub fn encode(fin: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 14);
    out.push(if fin { 0x80 } else { 0 } | (opcode & 0x0F));
    let m = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => out.push(m | n as u8),
        n if n <= usize::from(u16::MAX) => {
            out.push(m | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(m | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    let start = out.len() + mask.map_or(0, |_| 4);
    if let Some(k) = mask {
        out.extend_from_slice(&k);
    }
    out.extend_from_slice(payload);
    if let Some(k) = mask {
        apply_mask(&mut out[start..], k);
    }
    out
}

/// What [`Messages::push`] gives back once it is whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A control frame (close, ping, pong), which may come between the
    /// fragments of a message.
    Control(Frame),
    /// A whole message: `TEXT` or `BINARY`, its fragments joined.
    Message { opcode: u8, payload: Vec<u8> },
}

/// Joins data frames into messages, at most `max` bytes each.
pub struct Messages {
    max: usize,
    /// The opcode of the message in progress and its bytes so far.
    open: Option<(u8, Vec<u8>)>,
}

impl Messages {
    pub fn new(max: usize) -> Messages {
        Messages { max, open: None }
    }

    /// Takes the next frame; returns an item when one is whole.
    pub fn push(&mut self, f: Frame) -> Result<Option<Item>, FrameError> {
        if f.is_control() {
            return Ok(Some(Item::Control(f)));
        }
        let (opcode, mut payload) = match (f.opcode, self.open.take()) {
            (CONTINUATION, Some((op, mut so_far))) => {
                if so_far.len() + f.payload.len() > self.max {
                    return Err(FrameError::TooBig((so_far.len() + f.payload.len()) as u64));
                }
                so_far.extend_from_slice(&f.payload);
                (op, so_far)
            }
            (CONTINUATION, None) => return Err(FrameError::Protocol("a continuation frame outside a message")),
            (_, Some(_)) => return Err(FrameError::Protocol("a new message before the last one ended")),
            (op, None) => (op, f.payload),
        };
        if f.fin {
            payload.shrink_to_fit();
            return Ok(Some(Item::Message { opcode, payload }));
        }
        self.open = Some((opcode, payload));
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: usize = 1 << 20;

    fn one(bytes: &[u8], masked: bool) -> Frame {
        let (f, n) = parse(bytes, masked, MAX).unwrap().unwrap();
        assert_eq!(n, bytes.len());
        f
    }

    #[test]
    fn the_example_frames_of_the_rfc() {
        // RFC 6455 §5.7: "Hello", unmasked and masked.
        let f = one(&[0x81, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f], false);
        assert_eq!((f.fin, f.opcode, &f.payload[..]), (true, TEXT, &b"Hello"[..]));
        let masked = [0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58];
        assert_eq!(one(&masked, true).payload, b"Hello");
        assert_eq!(encode(true, TEXT, b"Hello", Some([0x37, 0xfa, 0x21, 0x3d])), masked);
        assert_eq!(
            encode(true, TEXT, b"Hello", None),
            [0x81, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f]
        );
        // A fragmented text message, and a ping.
        let mut m = Messages::new(MAX);
        assert_eq!(m.push(one(&[0x01, 0x03, 0x48, 0x65, 0x6c], false)), Ok(None));
        assert_eq!(
            m.push(one(&[0x89, 0x02, b'h', b'i'], false)),
            Ok(Some(Item::Control(Frame {
                fin: true,
                opcode: PING,
                payload: b"hi".to_vec()
            })))
        );
        assert_eq!(
            m.push(one(&[0x80, 0x02, 0x6c, 0x6f], false)),
            Ok(Some(Item::Message {
                opcode: TEXT,
                payload: b"Hello".to_vec()
            }))
        );
    }

    #[test]
    fn lengths_of_7_16_and_64_bits_round_trip_masked_and_not() {
        for n in [0usize, 1, 125, 126, 127, 65535, 65536, 70_000] {
            let payload: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
            for mask in [None, Some([1, 2, 3, 4])] {
                let wire = encode(true, BINARY, &payload, mask);
                let header =
                    2 + if n < 126 {
                        0
                    } else if n <= 65535 {
                        2
                    } else {
                        8
                    } + mask.map_or(0, |_| 4);
                assert_eq!(wire.len(), header + n, "{n} {mask:?}");
                // Any prefix is incomplete, never an error.
                for cut in [0, 1, header - 1, wire.len() - 1] {
                    assert_eq!(parse(&wire[..cut], mask.is_some(), MAX), Ok(None), "{n} cut at {cut}");
                }
                let f = one(&wire, mask.is_some());
                assert_eq!((f.fin, f.opcode), (true, BINARY));
                assert_eq!(f.payload, payload, "{n} {mask:?}");
            }
        }
        // Two frames back to back: the first only.
        let mut two = encode(true, TEXT, b"a", Some([9, 9, 9, 9]));
        two.extend(encode(true, TEXT, b"b", Some([9, 9, 9, 9])));
        let (f, n) = parse(&two, true, MAX).unwrap().unwrap();
        assert_eq!((f.payload, n), (b"a".to_vec(), 7));
    }

    #[test]
    fn masking_is_required_from_the_client_and_refused_from_the_server() {
        let masked = encode(true, TEXT, b"x", Some([1, 2, 3, 4]));
        let plain = encode(true, TEXT, b"x", None);
        assert!(matches!(parse(&plain, true, MAX), Err(FrameError::Protocol(_))));
        assert!(matches!(parse(&masked, false, MAX), Err(FrameError::Protocol(_))));
    }

    #[test]
    fn oversize_is_refused_from_the_header_and_while_joining() {
        // A 64-bit length announcing 2^40 bytes: refused with 10 bytes read.
        let mut head = vec![0x82, 0x7F];
        head.extend_from_slice(&(1u64 << 40).to_be_bytes());
        assert_eq!(parse(&head, false, MAX), Err(FrameError::TooBig(1 << 40)));
        let mut huge = vec![0x82, 0x7F];
        huge.extend_from_slice(&u64::MAX.to_be_bytes());
        assert!(matches!(parse(&huge, false, MAX), Err(FrameError::Protocol(_))));
        // Fragments that together pass the cap.
        let mut m = Messages::new(10);
        let frag = |fin, op, p: &[u8]| Frame {
            fin,
            opcode: op,
            payload: p.to_vec(),
        };
        assert_eq!(m.push(frag(false, TEXT, b"123456")), Ok(None));
        assert_eq!(m.push(frag(false, CONTINUATION, b"7890")), Ok(None));
        assert_eq!(m.push(frag(true, CONTINUATION, b"1")), Err(FrameError::TooBig(11)));
    }

    #[test]
    fn what_rfc_6455_forbids_is_refused() {
        let frag = |fin, op, p: &[u8]| Frame {
            fin,
            opcode: op,
            payload: p.to_vec(),
        };
        // Reserved bits, reserved opcodes, long or fragmented control frames.
        assert!(parse(&[0xC1, 0x00], false, MAX).is_err());
        assert!(parse(&[0x83, 0x00], false, MAX).is_err());
        assert!(parse(&[0x09, 0x00], false, MAX).is_err());
        let long_ping = encode(true, PING, &[0; 126], None);
        assert!(parse(&long_ping, false, MAX).is_err());
        // Continuation without a message, a message inside a message.
        let mut m = Messages::new(MAX);
        assert!(m.push(frag(true, CONTINUATION, b"x")).is_err());
        let mut m = Messages::new(MAX);
        assert_eq!(m.push(frag(false, BINARY, b"x")), Ok(None));
        assert!(m.push(frag(true, TEXT, b"y")).is_err());
    }
}
