//! A TCP proxy on 127.0.0.1 that can take a peer away on command: forward everything, refuse
//! (accept and close at once, cutting the open connections too), or let requests through and
//! swallow the first reply before cutting the connection, which is how an acknowledgement gets
//! lost after the server committed; or go silent: accept and read everything, forward nothing,
//! answer nothing and close nothing, as a peer whose request threads are all stuck does.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Forward,
    /// New connections are closed at once; open ones are cut.
    Down,
    /// Requests reach the server; its next reply is dropped and the connection cut.
    SwallowReplies,
    /// Connections are accepted (new ones too) and read, but nothing reaches the server and
    /// nothing comes back; none is closed by the proxy.
    Silent,
}

pub struct TcpProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Mode::Forward);
        let modes = mode.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *modes.borrow() == Mode::Down {
                    drop(client);
                    continue;
                }
                if *modes.borrow() == Mode::Silent {
                    tokio::spawn(swallow(client));
                    continue;
                }
                tokio::spawn(pipe(client, upstream, modes.subscribe()));
            }
        });
        TcpProxy { addr, mode, accept }
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.mode.send_replace(Mode::Down);
    }
}

async fn pipe(client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let mut to_server = vec![0u8; 16 * 1024];
    let mut to_client = vec![0u8; 16 * 1024];
    // The mode is read again before anything is forwarded, so bytes that arrive after `set`
    // returned obey the new mode whichever branch wakes first.
    loop {
        tokio::select! {
            read = client_read.read(&mut to_server) => match read {
                Ok(0) | Err(_) => return,
                Ok(_) if *mode.borrow() == Mode::Down => return,
                Ok(_) if *mode.borrow() == Mode::Silent => {}
                Ok(n) => if server_write.write_all(&to_server[..n]).await.is_err() { return },
            },
            read = server_read.read(&mut to_client) => match read {
                Ok(0) | Err(_) => return,
                Ok(_) if *mode.borrow() == Mode::Silent => {}
                Ok(_) if *mode.borrow() != Mode::Forward => return,
                Ok(n) => if client_write.write_all(&to_client[..n]).await.is_err() { return },
            },
            changed = mode.changed() => {
                if changed.is_err() || *mode.borrow() == Mode::Down {
                    return;
                }
            }
        }
    }
}

/// Reads and drops what a client sends until it goes away; answers nothing.
async fn swallow(mut client: TcpStream) {
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = client.read(&mut buf).await {
        if n == 0 {
            return;
        }
    }
}
