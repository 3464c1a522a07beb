//! Loopback addresses for tests that need one nobody answers at.

use std::net::SocketAddr;

use tokio::net::TcpSocket;

/// An address on 127.0.0.1 that refuses every connection, and the socket that holds it: bound
/// but never listening, so connecting fails at once and no other test or process can take the
/// port while the socket lives (a port bound, freed and handed out could be).
pub fn refusing_address() -> (TcpSocket, SocketAddr) {
    let socket = TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("a loopback port");
    let addr = socket.local_addr().expect("the bound address");
    (socket, addr)
}

#[tokio::test]
async fn the_refusing_address_refuses_at_once() {
    let (_held, addr) = refusing_address();
    let error = tokio::net::TcpStream::connect(addr).await.unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::ConnectionRefused);
}
