//! What the data plane's unit tests share: a runtime like a worker's (I/O, no timers: the
//! connection's alarm is a timerfd) and a loopback connection.

use std::net::SocketAddr;

/// A current-thread runtime with I/O and without tokio's timers, as a network worker's.
pub(super) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("a test runtime")
}

/// A loopback connection: the target's end registered with `rt`, the host's end blocking,
/// and the host's address as the target sees it.
pub(super) fn loopback(
    rt: &tokio::runtime::Runtime,
) -> (tokio::net::TcpStream, std::net::TcpStream, SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let host = std::net::TcpStream::connect(listener.local_addr().expect("its address"))
        .expect("a loopback connection");
    let (target, peer) = listener.accept().expect("the connection accepted");
    target.set_nonblocking(true).expect("non-blocking");
    let _entered = rt.enter();
    let target = tokio::net::TcpStream::from_std(target).expect("registered with the runtime");
    (target, host, peer)
}
