use std::io::Read;
use std::io::Result as IoResult;
use std::sync::mpsc::channel;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// A `Reader` that reads exactly the number of bytes from a sub-reader.
///
/// If the limit is reached, it returns EOF. If the limit is not reached
/// when the destructor is called, the remaining bytes are left unread and
/// `abandoned` is set: the connection must not be read from again.
pub struct EqualReader<R>
where
    R: Read,
{
    reader: R,
    size: usize,
    last_read_signal: Sender<IoResult<()>>,
    abandoned: Arc<AtomicBool>,
}

impl<R> EqualReader<R>
where
    R: Read,
{
    pub fn new(reader: R, size: usize, abandoned: Arc<AtomicBool>) -> (EqualReader<R>, Receiver<IoResult<()>>) {
        let (tx, rx) = channel();

        let r = EqualReader {
            reader,
            size,
            last_read_signal: tx,
            abandoned,
        };

        (r, rx)
    }
}

impl<R> Read for EqualReader<R>
where
    R: Read,
{
    fn read(&mut self, buf: &mut [u8]) -> IoResult<usize> {
        if self.size == 0 {
            return Ok(0);
        }

        let buf = if buf.len() < self.size {
            buf
        } else {
            &mut buf[..self.size]
        };

        match self.reader.read(buf) {
            Ok(len) => {
                self.size -= len;
                Ok(len)
            }
            err @ Err(_) => err,
        }
    }
}

// dualedit's patch: the unread rest of a body is never drained. 0.12.0 drained it with
// `vec![0; remaining_to_read]`, an allocation of the size the client declared (a
// `Content-Length: 99999999999` aborted the process) and a read that waits for as long as
// the client likes. Now nothing is read: the connection is marked abandoned and closed
// after the response, so no request is ever parsed out of an unread body.
impl<R> Drop for EqualReader<R>
where
    R: Read,
{
    fn drop(&mut self) {
        if self.size > 0 {
            self.abandoned.store(true, Ordering::SeqCst);
        }
        self.last_read_signal.send(Ok(())).ok();
    }
}

#[cfg(test)]
mod tests {
    use super::EqualReader;
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn test_limit() {
        use std::io::Cursor;

        let mut org_reader = Cursor::new("hello world".to_string().into_bytes());
        let abandoned = Arc::new(AtomicBool::new(false));

        {
            let (mut equal_reader, _) = EqualReader::new(org_reader.by_ref(), 5, abandoned.clone());

            let mut string = String::new();
            equal_reader.read_to_string(&mut string).unwrap();
            assert_eq!(string, "hello");
        }

        let mut string = String::new();
        org_reader.read_to_string(&mut string).unwrap();
        assert_eq!(string, " world");
        assert!(!abandoned.load(Ordering::SeqCst));
    }

    #[test]
    fn test_not_enough() {
        use std::io::Cursor;

        let mut org_reader = Cursor::new("hello world".to_string().into_bytes());
        let abandoned = Arc::new(AtomicBool::new(false));

        {
            let (mut equal_reader, _) = EqualReader::new(org_reader.by_ref(), usize::MAX, abandoned.clone());

            let mut vec = [0];
            equal_reader.read_exact(&mut vec).unwrap();
            assert_eq!(vec[0], b'h');
        }

        // Nothing more was read (no allocation of the declared size either).
        let mut string = String::new();
        org_reader.read_to_string(&mut string).unwrap();
        assert_eq!(string, "ello world");
        assert!(abandoned.load(Ordering::SeqCst));
    }
}
