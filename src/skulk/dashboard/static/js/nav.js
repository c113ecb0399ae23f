// In-page navigation: push the path and tell the shell; the server serves index.html for these paths too.
export function navigate(path) {
  if (path !== window.location.pathname) window.history.pushState({}, '', path);
  window.dispatchEvent(new Event('skulk:navigate'));
}
