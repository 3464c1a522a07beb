// Preloaded with `node -r` into servers that bind every interface and have no host option
// (@modelcontextprotocol/server-everything): makes every TCP listen bind 127.0.0.1 so the
// interop tests never listen beyond loopback, and announces each port bound on stdout as
// `{"event":"listening","port":<port>}`, so a test can start the server on port 0 and learn the
// port it got (instead of picking a free port that someone else could take first).
'use strict';
const net = require('net');
const original = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  if (typeof args[0] === 'object' && args[0] !== null && !Array.isArray(args[0])) {
    args[0] = { ...args[0], host: '127.0.0.1' };
  } else if (typeof args[0] === 'number' || (typeof args[0] === 'string' && /^\d+$/.test(args[0]))) {
    // listen(port[, host][, backlog][, callback])
    if (typeof args[1] === 'string') {
      args[1] = '127.0.0.1';
    } else {
      args.splice(1, 0, '127.0.0.1');
    }
  }
  this.once('listening', () => {
    const address = this.address();
    if (address !== null && typeof address === 'object') {
      process.stdout.write(JSON.stringify({ event: 'listening', port: address.port }) + '\n');
    }
  });
  return original.apply(this, args);
};
