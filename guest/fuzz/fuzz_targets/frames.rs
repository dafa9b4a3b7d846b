//! Everything an untrusted peer can send, fed to the protocol decoder: the
//! byte stream is cut into frames both incrementally and through the
//! blocking reader, and every payload goes through each message parser
//! either side uses. Nothing may panic, hang or allocate beyond the frame
//! limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandbox_agent::proto::{
    self, decode_frame, ErrorBody, Event, FrameReader, Header, Hello, Kind, Request, Response,
};

fuzz_target!(|data: &[u8]| {
    // Incremental decoder over the buffer.
    let mut rest = data;
    while let Ok(Some((frame, used))) = decode_frame(rest) {
        assert!(used >= proto::HEADER_LEN && used <= rest.len());
        assert!(frame.payload.len() <= proto::MAX_PAYLOAD);
        // A decoded header re-encodes to the same bytes.
        let mut hb = [0u8; proto::HEADER_LEN];
        hb.copy_from_slice(&rest[..proto::HEADER_LEN]);
        assert_eq!(Header::decode(&hb).ok().map(|h| h.encode()), Some(hb));
        parse_payload(frame.kind(), &frame.payload);
        rest = &rest[used..];
    }
    // Blocking reader over the same bytes must agree frame for frame.
    let mut r = FrameReader::new(data);
    let mut n = 0usize;
    while let Ok(Some(f)) = r.read_frame() {
        n += 1;
        assert!(f.payload.len() <= proto::MAX_PAYLOAD);
        if n > data.len() {
            panic!("more frames than bytes");
        }
    }
    // And every parser on the raw input, as if it were a payload.
    for k in [Kind::Hello, Kind::Request, Kind::Response, Kind::Event, Kind::Error] {
        parse_payload(Some(k), data);
    }
});

fn parse_payload(kind: Option<Kind>, p: &[u8]) {
    match kind {
        Some(Kind::Hello) => {
            let _ = serde_json::from_slice::<Hello>(p);
        }
        Some(Kind::Request) => {
            if let Ok(r) = serde_json::from_slice::<Request>(p) {
                // What parses must serialise back and parse to the same value.
                let again = serde_json::to_vec(&r).expect("serialise request");
                let r2: Request = serde_json::from_slice(&again).expect("reparse request");
                assert_eq!(r, r2);
            }
        }
        Some(Kind::Response) => {
            let _ = serde_json::from_slice::<Response>(p);
        }
        Some(Kind::Event) => {
            let _ = serde_json::from_slice::<Event>(p);
        }
        Some(Kind::Error) => {
            let _ = serde_json::from_slice::<ErrorBody>(p);
        }
        _ => {}
    }
}
