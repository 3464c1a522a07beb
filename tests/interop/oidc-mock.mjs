// oauth2-mock-server started as a library, for the tests in tests/it/secure.rs that need what
// its CLI cannot do: short-lived tokens, a token without the requested scope, a client secret
// that is really checked, an issuer URL in front of it, and signing keys that survive a restart.
//
//   node tests/interop/oidc-mock.mjs <path to oauth2-mock-server/dist/index.mjs>
//
// Environment (all optional):
//   OIDC_MOCK_ISSUER         the issuer URL to advertise (default http://localhost:<port>), for
//                            a test that holds the address in front of it
//   OIDC_MOCK_TTL            token lifetime in seconds (`exp` and `expires_in`; default 3600)
//   OIDC_MOCK_SCOPE          the scope put into tokens instead of the requested one
//   OIDC_MOCK_CLIENT_SECRET  the only client secret accepted; others get 401 invalid_client
//   OIDC_MOCK_KEYS           a JSON file of signing keys: read when it exists, else written
//
// It binds a port of 127.0.0.1 that the system picks. Stdout, one JSON object per line:
//   {"event":"listening","issuer":"<the issuer URL>","port":<port>}
//   {"event":"token","status":200,"access_token":"...","scope":"...","at_ms":...}  (one per request)
// While running, `POST /__mock/config` with a JSON body {"ttl", "scope", "clientSecret"} changes
// the settings above (null clears one); `GET /__mock/config` shows them.
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { randomUUID } from 'node:crypto';
import { pathToFileURL } from 'node:url';

const entry = process.argv[2];
if (!entry) {
  console.error('usage: node oidc-mock.mjs <path to oauth2-mock-server/dist/index.mjs>');
  process.exit(2);
}
const { OAuth2Server, Events } = await import(pathToFileURL(entry).href);

const settings = {
  ttl: Number(process.env.OIDC_MOCK_TTL ?? 3600),
  scope: process.env.OIDC_MOCK_SCOPE ?? null,
  clientSecret: process.env.OIDC_MOCK_CLIENT_SECRET ?? null,
};

const server = new OAuth2Server();
const keysFile = process.env.OIDC_MOCK_KEYS;
if (keysFile && existsSync(keysFile)) {
  for (const key of JSON.parse(readFileSync(keysFile, 'utf8'))) {
    await server.issuer.keys.add(key);
  }
} else {
  await server.issuer.keys.generate('RS256');
  if (keysFile) {
    writeFileSync(keysFile, JSON.stringify(server.issuer.keys.toJSON(true)));
  }
}

/** The client secret a token request presents (Basic header or form body), or null. */
function presentedSecret(req) {
  const header = req.headers.authorization ?? '';
  if (header.startsWith('Basic ')) {
    const decoded = Buffer.from(header.slice(6), 'base64').toString('utf8');
    const colon = decoded.indexOf(':');
    if (colon >= 0) {
      // RFC 6749 2.3.1: both parts are form-urlencoded before they are joined.
      return decodeURIComponent(decoded.slice(colon + 1).replace(/\+/g, ' '));
    }
  }
  return req.body?.client_secret ?? null;
}

server.service.on(Events.BeforeTokenSigning, (token) => {
  const now = Math.floor(Date.now() / 1000);
  token.payload.exp = now + settings.ttl;
  // Every token distinct, even two issued in the same second.
  token.payload.jti = randomUUID();
  if (settings.scope !== null) {
    token.payload.scope = settings.scope;
  }
});

server.service.on(Events.BeforeResponse, (response, req) => {
  if (settings.clientSecret !== null && presentedSecret(req) !== settings.clientSecret) {
    response.statusCode = 401;
    response.body = { error: 'invalid_client', error_description: 'client authentication failed' };
  } else if (response.statusCode === 200) {
    response.body.expires_in = settings.ttl;
    if (settings.scope !== null) {
      response.body.scope = settings.scope;
    }
  }
  console.log(JSON.stringify({
    event: 'token',
    status: response.statusCode,
    access_token: response.statusCode === 200 ? response.body.access_token : null,
    scope: response.statusCode === 200 ? response.body.scope : null,
    at_ms: Date.now(),
  }));
});

server.service.addRoute('GET', '/__mock/config', (_req, res) => {
  res.setHeader('content-type', 'application/json');
  res.end(JSON.stringify(settings));
});
server.service.addRoute('POST', '/__mock/config', (req, res) => {
  const body = req.body ?? {};
  for (const name of ['ttl', 'scope', 'clientSecret']) {
    if (name in body) {
      settings[name] = body[name];
    }
  }
  if (settings.ttl === null) settings.ttl = 3600;
  res.setHeader('content-type', 'application/json');
  res.end(JSON.stringify(settings));
});

if (process.env.OIDC_MOCK_ISSUER) {
  server.issuer.url = process.env.OIDC_MOCK_ISSUER;
}
await server.start(0, '127.0.0.1');
console.log(JSON.stringify({
  event: 'listening',
  issuer: server.issuer.url,
  port: server.address().port,
}));

for (const signal of ['SIGTERM', 'SIGINT']) {
  process.on(signal, () => server.stop().finally(() => process.exit(0)));
}
