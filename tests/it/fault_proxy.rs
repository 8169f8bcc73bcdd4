//! A TCP relay on loopback that cuts connections at random (rule I7's
//! tests): between a store and its PostgreSQL or Redis server, it forwards
//! each chunk a client sends and, by chance, cuts the connection either
//! before forwarding it (the request certainly never arrived) or right
//! after forwarding it, dropping whatever the server answers (the request
//! arrived and was most likely executed, but its answer is lost: the
//! "maybe applied" case).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// What the relay does to each chunk from a client, once faults are on.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    /// Chance of cutting before forwarding a chunk.
    pub cut_before: f64,
    /// Chance of forwarding a chunk, then dropping the answer and cutting.
    pub cut_after: f64,
}

/// How many cuts of each kind the relay made.
#[derive(Default, Debug)]
pub struct Cuts {
    pub before: AtomicU64,
    pub after: AtomicU64,
    pub connections: AtomicU64,
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    faults: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    pub cuts: Arc<Cuts>,
}

impl FaultProxy {
    /// A relay to `upstream` on a free loopback port; faults start off.
    pub fn start(upstream: SocketAddr, plan: Plan) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let addr = listener.local_addr().expect("its address");
        let faults = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(Cuts::default());
        let (f, s, c) = (faults.clone(), stop.clone(), cuts.clone());
        std::thread::spawn(move || {
            let seed = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
            for client in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                c.connections.fetch_add(1, Ordering::Relaxed);
                let rng = seed.fetch_add(0x2545_f491_4f6c_dd1d, Ordering::Relaxed) | 1;
                relay(client, server, plan, rng, f.clone(), c.clone());
            }
        });
        FaultProxy {
            addr,
            faults,
            stop,
            cuts,
        }
    }

    /// Turns the faults on or off (off while a store connects and sets up).
    pub fn faults(&self, on: bool) {
        self.faults.store(on, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the stop.
        let _ = TcpStream::connect(self.addr);
    }
}

/// xorshift64*: a fraction in [0, 1).
fn next(state: &mut u64) -> f64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
}

fn relay(
    client: TcpStream,
    server: TcpStream,
    plan: Plan,
    mut rng: u64,
    faults: Arc<AtomicBool>,
    cuts: Arc<Cuts>,
) {
    let drop_answers = Arc::new(AtomicBool::new(false));
    let cut = |a: &TcpStream, b: &TcpStream| {
        let _ = a.shutdown(Shutdown::Both);
        let _ = b.shutdown(Shutdown::Both);
    };
    // Server → client: forwards answers unless they are to be dropped.
    {
        let (mut from, mut to) = (
            server.try_clone().expect("clone"),
            client.try_clone().expect("clone"),
        );
        let drop_answers = drop_answers.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if drop_answers.load(Ordering::SeqCst) {
                            continue;
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
        });
    }
    // Client → server, deciding each chunk's fate.
    std::thread::spawn(move || {
        let (mut from, mut to) = (client, server);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if faults.load(Ordering::SeqCst) {
                let r = next(&mut rng);
                if r < plan.cut_before {
                    cuts.before.fetch_add(1, Ordering::Relaxed);
                    cut(&from, &to);
                    return;
                }
                if r < plan.cut_before + plan.cut_after {
                    // Answers from now on are dropped: set before the
                    // request goes, so none of its answer gets through.
                    drop_answers.store(true, Ordering::SeqCst);
                    let _ = to.write_all(&buf[..n]);
                    // Let the server act on it before the cut.
                    std::thread::sleep(Duration::from_millis(20));
                    cuts.after.fetch_add(1, Ordering::Relaxed);
                    cut(&from, &to);
                    return;
                }
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        cut(&from, &to);
    });
}

/// `host:port` of a `scheme://[user@]host:port/...` URL.
pub fn url_addr(url: &str) -> SocketAddr {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    hostport
        .parse()
        .unwrap_or_else(|e| panic!("{hostport:?} (from {url:?}) is not host:port: {e}"))
}

/// `url` with its `host:port` replaced by `addr`.
pub fn via(url: &str, addr: SocketAddr) -> String {
    let old = url_addr(url);
    url.replacen(&old.to_string(), &addr.to_string(), 1)
}
